"""The calculator task (tasks/calculator.py) played by an agent written only against
the official OpenAI client, as a user's own agent would be: the external-agent environment kind
(orchestrator/rollout/agent_environment.py) trains the model inside this loop.

    [orchestrator.environment]
    class = "tasks.calculator_agent:CalculatorAgent"
"""

from __future__ import annotations

import json

from orchestrator.rollout.tool_functions import Tool
from tasks.calculator import Calculator, calculate

TOOLS = [Tool.from_function(calculate).schema]


class CalculatorAgent(Calculator):
    tools = None  # the agent holds the tools itself; the orchestrator only serves the model
    max_turns = 3

    async def agent(self, row: dict, access) -> list[dict]:
        messages = [{"role": "user", "content": row["prompt"]}]
        async with access.client() as client:  # its connections closed with the episode
            for _ in range(self.max_turns):
                answer = await client.chat.completions.create(model=access.model, messages=messages, tools=TOOLS)
                message = answer.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    try:
                        result = calculate(**json.loads(call.function.arguments))
                    except Exception as e:  # the model's own mistake: it reads the error, as in the built-in loop
                        result = f"error: {e}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return messages  # scored by Calculator.reward, the final answer against the row's
