"""Every config class of the vendored vLLM traces draws, within 80 columns, and explains."""

from pathlib import Path

import pytest

from kvref.viz.explain import explain
from kvref.viz.panels import render_frame
from kvref.viz.player import TracePlayer, read_trace
from tests.viz.helpers import text_of, widest_line

CLASSES = Path(__file__).parents[1] / "conformance" / "traces"


@pytest.mark.parametrize("config_class", sorted(p.name for p in CLASSES.iterdir() if p.is_dir()))
def test_frames_of_every_config_class(config_class):
    path = sorted((CLASSES / config_class).glob("*.json.gz"))[0]
    trace = read_trace(str(path))
    player = TracePlayer(trace)
    for step in (0, len(player.steps) // 2, len(player.steps) - 1):
        player.seek_step(step)
        text = text_of(render_frame(player, verbose=True))
        assert widest_line(text) <= 80
        assert f"step {step}/{len(player.steps) - 1}" in text
    groups = trace["header"]["groups"]
    assert all(f"g{i} " in text for i in range(len(groups))) or "no request holds" in text
    for i, op in enumerate(trace["ops"]):
        if op["op"] in ("get_computed_blocks", "allocate_slots", "free"):
            assert explain(trace, i)[1].startswith("what happened: ")
            break


@pytest.mark.parametrize("config_class", ["full", "hybrid_full_swa", "swa", "cross_attention",
                                          "mamba_align", "eagle", "no_caching"])
def test_explain_names_a_gate_exactly_when_vllm_refused(config_class):
    """The gate arithmetic of explain agrees with vLLM's own answers."""
    path = sorted((CLASSES / config_class).glob("*.json.gz"))[0]
    trace = read_trace(str(path))
    checked = refused = 0
    for i, op in enumerate(trace["ops"][:150]):
        if op["op"] != "allocate_slots" or "raises" in op["expect"]:
            continue
        text = "\n".join(explain(trace, i))
        assert ("REFUSED" in text) == (op["expect"].get("ret") is None), (i, text)
        checked += 1
        refused += op["expect"].get("ret") is None
    assert checked >= 5 and refused >= 1
