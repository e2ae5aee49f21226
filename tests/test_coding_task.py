"""The coding task set and its reward through the real sandbox; the python tool's answers."""

from __future__ import annotations

import asyncio
import itertools

from orchestrator.tasks import coding
from orchestrator.tasks.python_tool import python
from orchestrator.tools import Tool


def test_reference_solutions_pass_every_test_and_wrong_or_hostile_code_scores_less():
    rows = list(itertools.islice(coding.dataset(0), 12))
    assert len({r["prompt"] for r in rows}) > 6  # varied
    assert list(itertools.islice(coding.dataset(0), 12)) == rows  # seeded

    async def scores():
        right = [coding.reward(r["prompt"], f"Here:\n```python\n{r['solution']}```", r) for r in rows]
        name = rows[0]["entry_point"]
        wrong = coding.reward(rows[0]["prompt"], f"```python\ndef {name}(*a):\n    return None\n```", rows[0])
        hang = coding.reward(rows[0]["prompt"], "while True: pass", rows[0])
        broken = coding.reward(rows[0]["prompt"], "def (", rows[0])
        return await asyncio.gather(*right), await asyncio.gather(wrong, hang, broken)

    right, (wrong, hang, broken) = asyncio.run(scores())
    assert right == [1.0] * len(rows)
    assert (wrong, hang, broken) == (0.0, 0.0, 0.0)


def test_the_python_tool_describes_itself_and_answers_with_output_or_why_it_stopped():
    schema = Tool.from_function(python).schema["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert asyncio.run(python("print(6 * 7)")).strip() == "42"
    assert "ZeroDivisionError" in asyncio.run(python("1/0"))
    assert asyncio.run(python("import time; time.sleep(30)")).endswith("[timed out]")
