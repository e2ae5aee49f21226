"""The prompts station: which row a rollout starts from. Where the rows come from (rows.py: the
datasets, or the environment's dataset), each dataset's rows loaded (tables.py) and mixed by seed
(dataset_mix.py); the queue (queue.py, the interface the scheduler draws from) hands out the next
prompt, with prompts given back by cancelled groups first and rows skipped by the curriculum
(curriculum.py). A prompt is a row, not text: turning it into token ids is the rendering
station's (orchestrator/rendering/)."""

# The station's interface, as the scheduling loop and the other stations use it.
from orchestrator.prompts.curriculum import Curriculum
from orchestrator.prompts.dataset_mix import RowError, Source, configured_sources, draw_order, mix
from orchestrator.prompts.queue import Prompt, PromptQueue, decode_state, encode_state
from orchestrator.prompts.rows import Rows
from orchestrator.prompts.tables import load_table, row_problem

__all__ = ["Curriculum", "Prompt", "PromptQueue", "RowError", "Rows", "Source", "configured_sources",
           "decode_state", "draw_order", "encode_state", "load_table", "mix", "row_problem"]
