"use strict";
// kvref's trace player. The data (one JSON script element) holds every op's
// change from the op before, read from a real replay in Python
// (kvref/viz/html_player.py); this script only rebuilds and draws them.
(function () {
  const D = JSON.parse(document.getElementById("kvdata").textContent);
  const N = D.ops.length, NB = D.num_blocks, K = D.keyframe, S = D.steps.length;
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const GLYPH = {}, COLOUR = {};
  for (const [state, glyph, colour] of D.legend) { GLYPH[state] = glyph; COLOUR[state] = colour; }
  const TOUCHES_SHOWN = 5;      // as kvref/viz/details.py
  const PALETTE = ["#4aa3ff", "#3ccf4e", "#f0a030", "#e05d9b", "#9b7ede", "#35c3c3", "#d9d94a",
                   "#ff7f50", "#7fbf7f", "#c08040", "#6f8fff", "#ff5a5a"];

  // -- states ------------------------------------------------------------------
  // A state: blocks[id] = [ref count, hash index, parent index, group], the free
  // queue (block ids, head first) and reqs[id] = [status, computed tokens, tokens,
  // block hashes, block ids per group]. Records are replaced, never changed in place.
  const stepOf = new Int32Array(Math.max(N, 1));
  D.steps.forEach(([start, end], k) => { for (let i = start; i < end; i++) stepOf[i] = k; });

  function copy(st) {
    return { blocks: st.blocks.slice(), queue: st.queue, reqs: Object.assign({}, st.reqs) };
  }
  function apply(st, f) {
    if (f.b) for (const [id, ref, h, p, g] of f.b) st.blocks[id] = [ref, h, p, g];
    if (f.q) {
      if (f.q.all) st.queue = f.q.all;
      else {
        const gone = new Set(f.q.rm || []);
        st.queue = (f.q.h || []).concat(st.queue.filter((b) => !gone.has(b)), f.q.t || []);
      }
    }
    if (f.r) for (const r in f.r) st.reqs[r] = f.r[r];
  }
  // keys[j]: the state after op j*K.
  const keys = [];
  (function build() {
    const st = { blocks: D.initial.blocks, queue: D.initial.queue, reqs: {} };
    for (let k = 0; k < N; k++) {
      apply(st, D.frames[k]);
      if (k % K === 0) keys.push(copy(st));
    }
  })();
  let cur = null, curOp = -1;
  function stateAt(k) {
    if (cur !== null && k === curOp) return cur;
    if (cur !== null && k === curOp + 1) {
      apply(cur, D.frames[k]);
    } else {
      const j = Math.floor(k / K);
      cur = copy(keys[j]);
      for (let i = j * K + 1; i <= k; i++) apply(cur, D.frames[i]);
    }
    curOp = k;
    return cur;
  }

  function blockState(id, b) {
    if (id === 0) return "null";
    if (b[0] > 0) return b[1] >= 0 ? "used_cached" : "used";
    return b[1] >= 0 ? "free_cached" : "free";
  }
  function holdersOf(st) {
    const holders = {};
    for (const r in st.reqs) {
      st.reqs[r][4].forEach((ids, g) => {
        for (const id of ids) if (id !== 0) (holders[id] = holders[id] || []).push([r, g]);
      });
    }
    return holders;
  }
  function compress(ids) {
    const parts = [];
    let i = 0;
    while (i < ids.length) {
      let j = i;
      if (ids[i] === 0) {
        while (j + 1 < ids.length && ids[j + 1] === 0) j++;
        parts.push(j === i ? "∅" : "∅×" + (j - i + 1));
      } else {
        while (j + 1 < ids.length && ids[j + 1] === ids[j] + 1) j++;
        parts.push(j === i ? String(ids[i]) : ids[i] + "-" + ids[j]);
      }
      i = j + 1;
    }
    return parts.join(" ") || "-";
  }
  const reqOrder = {};
  let nextColour = 0;
  function reqColour(r) {
    if (!(r in reqOrder)) reqOrder[r] = nextColour++;
    return PALETTE[reqOrder[r] % PALETTE.length];
  }

  // -- the page's parts, built once ----------------------------------------------
  const view = { op: 0, verbose: false, byRequest: false, pinned: null, hover: null,
                 request: null, timer: null };
  const grid = $("grid"), cells = [];
  for (let id = 0; id < NB; id++) {
    const c = el("div", "cell");
    c.dataset.block = id;
    grid.appendChild(c);
    cells.push(c);
  }
  for (const [state, glyph, colour, words] of D.legend) {
    const s = el("span");
    const g = el("span", "g", glyph);
    g.style.color = colour;
    s.append(g, " " + words);
    $("legend").appendChild(s);
  }
  const opSlider = $("op-slider"), stepSlider = $("step-slider");
  opSlider.max = Math.max(N - 1, 0);
  stepSlider.max = Math.max(S - 1, 0);

  function plot(title, values, top, fmt) {
    const W = 600, H = 70, n = Math.max(values.length - 1, 1);
    const NS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const pts = values.map((v, i) =>
      `${(i / n * W).toFixed(1)},${(H - 4 - (top > 0 ? v / top : 0) * (H - 18)).toFixed(1)}`);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#35c3c3");
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    const cursor = document.createElementNS(NS, "line");
    cursor.setAttribute("y1", "0");
    cursor.setAttribute("y2", String(H));
    cursor.setAttribute("stroke", "#f0a030");
    cursor.setAttribute("vector-effect", "non-scaling-stroke");
    const label = document.createElementNS(NS, "text");
    label.setAttribute("x", "4");
    label.setAttribute("y", "12");
    label.setAttribute("class", "label");
    svg.append(line, cursor, label);
    $("plots").appendChild(svg);
    return (k) => {
      const x = (k / n * W).toFixed(1);
      cursor.setAttribute("x1", x);
      cursor.setAttribute("x2", x);
      label.textContent = `${title}: ${fmt(k)}`;
    };
  }
  const hitRate = D.hits.map((h, i) => (D.queries[i] ? h / D.queries[i] : 0));
  const pct = (v) => Math.round(v * 100) + "%";
  const plots = [
    plot("usage", D.usage, 1, (k) => pct(D.usage[k])),
    plot("hit rate (tokens, per lookup)", hitRate, 1,
         (k) => `${pct(hitRate[k])} (${D.hits[k]}/${D.queries[k]} tokens)`),
    plot("evictable cached blocks", D.evictable, Math.max(NB - 1, 1),
         (k) => String(D.evictable[k])),
  ];

  // -- drawing ---------------------------------------------------------------------
  function blockLines(id, st, k) {
    const b = st.blocks[id], state = blockState(id, b);
    const out = [`block ${id}: ${state.replace("_", " + ")}, ref count ${b[0]}`];
    if (b[1] >= 0) {
      out.push(`hash ${D.hashes[b[1]]}… (group ${b[3]})`);
      out.push(b[2] < 0 ? "parent: first block of its chain" : `parent ${D.hashes[b[2]]}…`);
    } else {
      out.push("no hash: nobody can hit it");
    }
    const holders = holdersOf(st)[id] || [];
    out.push("held by " + (holders.length
      ? holders.map(([r, g]) => `${r} (g${g})`).join(", ") : "no request"));
    const pos = st.queue.indexOf(id);
    if (pos >= 0) {
      out.push(`free queue: position ${pos} of ${st.queue.length} ` +
               `(${pos === 0 ? "allocated next" : "from the head"})`);
    } else if (state !== "null") {
      out.push("not in the free queue (in use)");
    }
    const ops = (D.touches[id] || []).filter((i) => i <= k);
    out.push(`touched by ${ops.length} op(s)` + (ops.length ? ":" : ""));
    if (ops.length > TOUCHES_SHOWN) out.push(`  … ${ops.length - TOUCHES_SHOWN} earlier`);
    for (const i of ops.slice(-TOUCHES_SHOWN)) {
      out.push(`  #${i} ${D.ops[i][0]}` + (D.ops[i][1] ? " " + D.ops[i][1] : ""));
    }
    if (D.kv_events !== null) {
      const evs = (D.kv_events[id] || []).filter(([i]) => i <= k);
      const shown = evs.slice(-TOUCHES_SHOWN).map(([i, kind]) => `#${i} ${kind}`).join(", ");
      out.push("KV events: " + (evs.length > TOUCHES_SHOWN ? "… " : "") + (shown || "none yet"));
    }
    return out;
  }
  function requestLines(r, st, k) {
    const q = st.reqs[r];
    if (!q) return [`request ${r}: not added yet at op ${k}`];
    const out = [`request ${r}: ${q[0].toLowerCase()}, ${q[1]}/${q[2]} tokens computed, ` +
                 `${q[3]} block hashes`];
    q[4].forEach((ids, g) => out.push(`g${g} blocks: ${compress(ids)}`));
    return out;
  }

  function drawTree(st) {
    const tree = $("tree");
    tree.textContent = "";
    const gid = D.prefix_group;
    if (gid === null) {
      $("tree-title").textContent = "prefix tree: no full-attention group to draw";
      return;
    }
    $("tree-title").textContent =
      `prefix tree (${D.groups[gid]}: requests sharing a prefix share a branch)`;
    const root = new Map();
    for (const r in st.reqs) {
      let node = root;
      for (const id of st.reqs[r][4][gid]) {
        if (!node.has(id)) node.set(id, { holders: [], children: new Map() });
        const n = node.get(id);
        n.holders.push(r);
        node = n.children;
      }
    }
    if (!root.size) { tree.textContent = "no request holds blocks"; return; }
    const add = (parent, trie) => {
      const ul = el("ul");
      for (let [id, n] of trie) {
        const run = [id];
        let children = n.children;
        while (children.size === 1) {
          const [nid, nn] = children.entries().next().value;
          if (nn.holders.slice().sort().join() !== n.holders.slice().sort().join()) break;
          run.push(nid);
          children = nn.children;
        }
        const states = new Set(run.map((b) => blockState(b, st.blocks[b])));
        const state = states.size === 1 ? [...states][0] : states.has("used") ? "used"
          : [...states].sort()[0];
        const li = el("li");
        const ids = el("b", null, compress(run) + " ");
        const g = el("span", null, GLYPH[state]);
        g.style.color = COLOUR[state];
        li.append(ids, g, (n.holders.length > 1 ? " shared by " : " ") + n.holders.join(" "));
        li.dataset.blocks = run.join(" ");
        if (children.size) add(li, children);
        ul.appendChild(li);
      }
      parent.appendChild(ul);
    };
    add(tree, root);
  }

  function draw() {
    const k = view.op, s = stepOf[k], st = stateAt(k);
    const [start, end] = D.steps[s];
    const top = $("pos");
    top.textContent = `${D.name}: step ${s}/${S - 1}, op ${k}/${N - 1} (${D.ops[k][0]})`;
    top.dataset.op = k;
    top.dataset.step = s;
    const story = D.narration[String(s)];
    const narration = $("narration");
    narration.textContent = story || "(no narration for this step: its ops are listed below)";
    narration.classList.toggle("none", !story);
    opSlider.value = k;
    stepSlider.value = s;
    const holders = holdersOf(st);
    const mine = new Set();
    if (view.request && st.reqs[view.request]) {
      for (const ids of st.reqs[view.request][4]) for (const id of ids) if (id) mine.add(id);
    }
    const counts = { null: 0, used: 0, used_cached: 0, free_cached: 0, free: 0 };
    for (let id = 0; id < NB; id++) {
      const b = st.blocks[id], state = blockState(id, b), c = cells[id];
      counts[state]++;
      c.className = "cell s-" + state;
      c.dataset.state = state;
      c.dataset.ref = b[0];
      c.textContent = id + GLYPH[state] +
        (state === "used" || state === "used_cached" ? (b[0] < 100 ? b[0] : "+") : "");
      const h = holders[id];
      c.dataset.holders = h ? h.map(([r, g]) => `${r}:${g}`).join(" ") : "";
      if (view.byRequest && h) {
        c.classList.add("held");
        c.style.background = reqColour(h[0][0]);
        c.style.boxShadow = h.length > 1 ? "inset 0 -4px 0 " + reqColour(h[1][0]) : "";
      } else {
        c.style.background = "";
        c.style.boxShadow = "";
      }
      if (id === view.pinned) c.classList.add("selected");
      if (mine.has(id)) c.classList.add("of-request");
    }
    $("totals").textContent =
      `in use ${counts.used + counts.used_cached} (cached ${counts.used_cached})  ` +
      `evictable cached ${counts.free_cached}  free empty ${counts.free}  null ${counts.null}`;
    const queue = $("queue");
    queue.textContent = "";
    if (!st.queue.length) queue.textContent = "(empty)";
    for (const id of st.queue) {
      const state = blockState(id, st.blocks[id]);
      const q = el("span", "fq s-" + state, id + GLYPH[state]);
      q.dataset.block = id;
      queue.appendChild(q);
    }
    // The step's ops: run ones, the current one, the ones still to come.
    const ops = $("ops");
    ops.textContent = "";
    $("ops-title").textContent = `ops of step ${s} (#${start}-#${end - 1})` +
      (view.verbose ? "" : ", scheduler bookkeeping hidden (v)");
    for (let i = start; i < end; i++) {
      const [name, , text, book] = D.ops[i];
      if (book && !view.verbose && i !== k) continue;
      const li = el("li", i === k ? "current" : i > k ? "future" : "");
      li.dataset.op = i;
      li.append(el("span", "i", `#${i} `), text);
      ops.appendChild(li);
    }
    const events = $("events");
    events.textContent = "";
    let any = false, taken = false;
    for (let i = start; i <= k; i++) {
      if (D.ops[i][0] === "take_events") taken = true;
      for (const line of D.frames[i].e || []) {
        events.appendChild(el("div", null, line));
        any = true;
      }
    }
    if (!any) events.textContent = taken ? "none" : "not taken yet this step";
    const tables = $("tables");
    tables.textContent = "";
    const head = el("tr");
    for (const h of ["request", "tokens", ...D.groups]) head.appendChild(el("th", null, h));
    tables.appendChild(head);
    for (const r in st.reqs) {
      const q = st.reqs[r];
      if (!q[4].some((ids) => ids.length)) continue;
      const tr = el("tr", "req" + (r === view.request ? " selected" : ""));
      tr.dataset.req = r;
      const name = el("td", null, r);
      name.style.color = reqColour(r);
      tr.append(name, el("td", null, `${q[1]}/${q[2]} ${q[0].toLowerCase()}`));
      for (const ids of q[4]) tr.appendChild(el("td", null, compress(ids)));
      tables.appendChild(tr);
    }
    drawTree(st);
    for (const p of plots) p(k);
    drawDetails();
  }

  function drawDetails() {
    const st = stateAt(view.op), box = $("details");
    const id = view.hover !== null ? view.hover : view.pinned;
    let lines;
    if (id !== null) lines = blockLines(id, st, view.op);
    else if (view.request !== null) lines = requestLines(view.request, st, view.op);
    else lines = ["hover a block (or click it, or a request's row) for its details"];
    box.textContent = lines.join("\n");
    box.classList.toggle("empty", id === null && view.request === null);
    box.dataset.block = id === null ? "" : id;
  }

  // -- moving ------------------------------------------------------------------------
  function say(text) { $("msg").textContent = text; }
  function go(k) {
    view.op = Math.max(0, Math.min(N - 1, k));
    draw();
  }
  function stepEnd(s) { return D.steps[s][1] - 1; }
  const moves = {
    nextStep() {
      const s = stepOf[view.op];
      if (s >= S - 1) return say("already at the last step");
      say(""); go(stepEnd(s + 1));
    },
    prevStep() {
      const s = stepOf[view.op];
      if (s <= 0) return say("already at the first step");
      say(""); go(stepEnd(s - 1));
    },
    nextOp() {
      if (view.op >= N - 1) return say("already at the last op");
      say(""); go(view.op + 1);
    },
    prevOp() {
      if (view.op <= 0) return say("already at the first op");
      say(""); go(view.op - 1);
    },
    first() { say(""); go(0); },
    last() { say(""); go(N - 1); },
    play() {
      if (view.timer) {
        clearInterval(view.timer);
        view.timer = null;
        $("b-play").textContent = "▶ play";
        return;
      }
      $("b-play").textContent = "⏸ pause";
      view.timer = setInterval(() => {
        if (stepOf[view.op] >= S - 1) { moves.play(); return; }
        moves.nextStep();
      }, 800);
    },
    ask(what) {
      const top = what === "step" ? S - 1 : N - 1;
      const answer = window.prompt(`${what} number, 0..${top}`);
      if (answer === null || answer.trim() === "") return;
      const n = Number(answer);
      if (!Number.isInteger(n) || n < 0 || n > top) {
        return say(`no ${what} ${answer.trim()}: ${what}s are 0..${top}`);
      }
      say(""); go(what === "step" ? stepEnd(n) : n);
    },
    search() {
      const answer = window.prompt("request id (or the start of one)");
      if (answer === null || answer.trim() === "") return;
      const text = answer.trim();
      const ids = Object.keys(stateAt(view.op).reqs);
      const match = ids.includes(text) ? text : ids.find((r) => r.startsWith(text));
      if (match === undefined) return say(`no request '${text}' yet at op ${view.op}`);
      selectRequest(match);
    },
  };
  function selectRequest(r) { view.request = r; view.pinned = null; say(""); draw(); }

  $("b-first").onclick = moves.first;
  $("b-last").onclick = moves.last;
  $("b-pstep").onclick = moves.prevStep;
  $("b-nstep").onclick = moves.nextStep;
  $("b-pop").onclick = moves.prevOp;
  $("b-nop").onclick = moves.nextOp;
  $("b-play").onclick = moves.play;
  $("b-help").onclick = () => { $("help").hidden = !$("help").hidden; };
  opSlider.addEventListener("input", () => { say(""); go(Number(opSlider.value)); });
  stepSlider.addEventListener("input", () => { say(""); go(stepEnd(Number(stepSlider.value))); });
  $("colour-by-request").addEventListener("change", (e) => {
    view.byRequest = e.target.checked;
    document.body.classList.toggle("by-request", view.byRequest);
    draw();
  });
  $("bookkeeping").addEventListener("change", (e) => { view.verbose = e.target.checked; draw(); });
  const blockOf = (e) => {
    const t = e.target.closest("[data-block]");
    return t && (t.classList.contains("cell") || t.classList.contains("fq"))
      ? Number(t.dataset.block) : null;
  };
  for (const box of [grid, $("queue")]) {
    box.addEventListener("mouseover", (e) => {
      const id = blockOf(e);
      if (id !== null) { view.hover = id; drawDetails(); }
    });
    box.addEventListener("mouseleave", () => { view.hover = null; drawDetails(); });
    box.addEventListener("click", (e) => {
      const id = blockOf(e);
      if (id === null) return;
      view.pinned = id === view.pinned ? null : id;
      view.request = null;
      draw();
    });
  }
  $("tables").addEventListener("click", (e) => {
    const tr = e.target.closest("tr.req");
    if (tr) selectRequest(tr.dataset.req);
  });
  $("ops").addEventListener("click", (e) => {
    const li = e.target.closest("li");
    if (li) { say(""); go(Number(li.dataset.op)); }
  });
  document.addEventListener("keydown", (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const onSlider = e.target instanceof HTMLInputElement && e.target.type === "range";
    const key = e.key;
    const action = {
      n: moves.nextStep, PageDown: moves.nextStep, p: moves.prevStep, PageUp: moves.prevStep,
      ".": moves.nextOp, ",": moves.prevOp, Home: moves.first, End: moves.last,
      ArrowRight: moves.nextOp, ArrowLeft: moves.prevOp, " ": moves.play,
      g: () => moves.ask("step"), o: () => moves.ask("op"), "/": moves.search,
      c: () => $("colour-by-request").click(), v: () => $("bookkeeping").click(),
      "?": () => { $("help").hidden = !$("help").hidden; },
      Escape: () => {
        view.pinned = view.request = null;
        $("help").hidden = true;
        say("");
        draw();
      },
    }[key];
    if (!action) return;
    // A focused slider moves itself with the arrows and Home/End; its input event follows.
    const sliderKeys = ["ArrowRight", "ArrowLeft", "Home", "End", "PageUp", "PageDown"];
    if (onSlider && sliderKeys.includes(key)) return;
    e.preventDefault();
    action();
  });

  // For tests and notebooks: where the player is, and a way to move it.
  window.kvPlayer = { go, moves, state: () => stateAt(view.op), view, data: D };
  if (N) go(Math.max(0, Math.min(N - 1, D.start || 0)));
  else $("pos").textContent = `${D.name}: no ops`;
})();
