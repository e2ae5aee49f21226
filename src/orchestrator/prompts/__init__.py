"""The prompts station: what a rollout starts from. Datasets' rows are loaded (tables.py), mixed
by seed (dataset_mix.py), rendered by the model's chat template (chat.py) and tokenized (tokenizer.py);
the queue (queue.py, the interface the scheduler draws from) hands out the next prompt, with
prompts given back by cancelled groups first and rows skipped by the curriculum (curriculum.py).
fit.py is the start-up check that the first prompts leave room for a completion."""

# The station's interface, as the scheduling loop and the other stations use it.
from orchestrator.prompts.curriculum import Curriculum
from orchestrator.prompts.dataset_mix import Renderer, RowError, Source
from orchestrator.prompts.queue import Prompt, PromptQueue
from orchestrator.prompts.tokenizer import load_tokenizer

__all__ = ["Curriculum", "Prompt", "PromptQueue", "Renderer", "RowError", "Source", "load_tokenizer"]
