"""Every vLLM internal the project touches, in one list, checked against the installed vLLM by
tests/inference/test_vllm_contract.py: an upgrade that moves one fails that test, not a user's run.
docs/vllm_contract.md says how to update it at a vLLM upgrade.

Plain data, importable without vLLM, in three parts:

  kinds.py      what an entry (Use) is: where it lives in vLLM (a dotted module, or MODEL_RUNNER /
                WORKER for the runner and worker classes picked by `runners`), what it is (kind),
                which runner(s) need it, where our source uses it, and why
  entries.py    USES: the entries, by the file of ours that relies on them
  our_files.py  our side: the files of ours that touch vLLM, where they hold vLLM objects
                (RECEIVERS), and what the test scans in the other direction: every `vllm` import,
                every attribute read off a vLLM object named in RECEIVERS, every VLLM_* variable
                and every `vllm serve` flag in CLI_FLAG_SOURCES must be an entry of USES
"""
