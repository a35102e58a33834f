"""The "questions answered by looking" (docs/pictures.md) get the answers it prints."""

import re
from pathlib import Path

import pytest

from tests.cli.test_cli import kvref

PAGE = Path(__file__).resolve().parents[2] / "docs" / "pictures.md"

# command on the page -> what its answer must say (whitespace-insensitive)
ANSWERS = {
    "kvref viz build/mt.json --step 20": ["in use 0 (cached 0) evictable cached 24"],
    "kvref explain build/mt.json --op 233": ["0 of 29 tokens hit", "token 2 differs (block 0)"],
    "kvref explain build/mt.json --op 60": ["20 of 29 tokens hit"],
    "kvref explain build/p.json --op 204": ["evicts cached", "Freed cached blocks join the tail"],
    "kvref explain build/p.json --op 143": ["REFUSED by the full-sequence gate",
                                            "needs 7 blocks + 1 watermark = 8, 6 are free: "
                                            "short by 2"],
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    where = tmp_path_factory.mktemp("questions")
    (where / "build").mkdir()                       # the page writes under build/
    for workload, name in (("multi-turn", "build/mt.json"), ("pressure", "build/p.json")):
        assert kvref("record", "--workload", workload, "-o", where / name).returncode == 0
    return where


def test_the_page_asks_exactly_these_questions():
    section = PAGE.read_text(encoding="utf-8").split("Questions answered by looking")[1]
    section = section.split("\n## ")[0]
    asked = set(re.findall(r"`(kvref (?:viz|explain) [^`]+)`", section))
    assert asked == set(ANSWERS), asked ^ set(ANSWERS)


@pytest.mark.parametrize("command", sorted(ANSWERS))
def test_each_question_gets_the_page_answer(traces, command):
    result = kvref(*command.split()[1:], cwd=traces)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    for phrase in ANSWERS[command]:
        assert phrase in out, (command, phrase, out[-1500:])
