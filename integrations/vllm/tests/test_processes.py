"""The plugin through vLLM's entry point in fresh processes: with the engine's worker
processes, and the settings that must stop the engine at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllm import SamplingParams

from conftest import TIMINGS
from helpers import PROMPTS, generate, token_ids

SCRIPT = textwrap.dedent("""
    import json, sys, vllm
    import vllm_logits_processor as vlp
    {before}
    llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                   seed=0)
    prompts = json.loads(sys.argv[2])
    greedy = llm.generate(prompts, vllm.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    seeded = llm.generate(prompts, [vllm.SamplingParams(temperature=0.9, top_k=40, seed=s, max_tokens=16,
                                                        ignore_eos=True) for s in range(len(prompts))],
                          use_tqdm=False)
    print("RESULT " + json.dumps({{
        "greedy": [list(o.outputs[0].token_ids) for o in greedy],
        "seeded": [list(o.outputs[0].token_ids) for o in seeded],
        "stats_here": vlp.stats(),
        "stats_workers": llm.collective_rpc("logits_processor_stats"),
    }}))
""")


def run_script(model, env_changes, before="", label=""):
    env = dict(os.environ, **env_changes)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(before=before), model, json.dumps(PROMPTS)],
                          env=env, capture_output=True, text=True, timeout=300)
    TIMINGS.append((label, time.perf_counter() - start))
    return done


def test_worker_processes_sample_through_the_plugin(engines, tiny_model):
    """The engine core and its worker in their own processes (vLLM's default): vLLM loads the
    plugin there through the entry point; tokens as in-process, greedy as vLLM's own."""
    engines.close()  # one engine process tree at a time
    done = run_script(tiny_model, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "LOGITS_PROCESSOR_SAMPLER": "on"},
                      label="subprocess: import, engine start with worker processes, 2 x 6 requests")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["stats_here"] == []  # nothing samples in the front-end process
    (worker,) = [s for stats in result["stats_workers"] for s in stats]
    assert worker["batches"] >= 32 and not worker["fallbacks"]
    reference = token_ids(generate(engines.get(False), PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                               ignore_eos=True), "greedy, vLLM"))
    assert result["greedy"] == reference
    in_process = token_ids(generate(engines.get(True), PROMPTS,
                                    [SamplingParams(temperature=0.9, top_k=40, seed=s, max_tokens=16, ignore_eos=True)
                                     for s in range(len(PROMPTS))], "seeded, plugin in-process"))
    assert result["seeded"] == in_process


@pytest.mark.parametrize("setting, before, expected", [
    ({"LOGITS_PROCESSOR_KERNEL": "/nonexistent/logits-processor-build"}, "",
     "LOGITS_PROCESSOR_KERNEL='/nonexistent/logits-processor-build': no such folder"),
    ({"LOGITS_PROCESSOR_KERNEL": str(Path(__file__).parent)}, "", "holds no kernel build"),
    ({}, "vllm.__version__ = '0.31.0'", "vLLM 0.31.0 is not supported"),
], ids=["unknown path", "folder without a build", "unsupported vLLM"])
def test_wrong_setting_fails_at_engine_start_naming_it(engines, tiny_model, setting, before, expected):
    engines.close()
    done = run_script(tiny_model, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **setting}, before=before,
                      label=f"subprocess: engine start refused ({expected[:40]})")
    assert done.returncode != 0
    assert expected in done.stderr, done.stderr[-3000:]
