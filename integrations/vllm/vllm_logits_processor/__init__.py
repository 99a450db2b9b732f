"""vLLM plugin: sampling through the logits-processor kernel package (Hugging Face Kernel Hub).

Installed, it is on: vLLM calls `register()` (entry point group `vllm.general_plugins`) in
every process it starts, before the model runner is built. `register()` checks the vLLM
version and the kernel setting and patches vLLM's V1 model runner (GPUModelRunner, which the CPU
runner extends) so that the runner, when built, loads the kernel and samples through it.

Settings (environment variables):
  LOGITS_PROCESSOR_KERNEL   the kernel: a Hub repo id (default phanerozoic/logits-processor,
                            version 1) or a local build folder such as build/
  LOGITS_PROCESSOR_SAMPLER  "on" (default) or "off": vLLM's own sampler, read when each
                            engine's model runner is built (so one process can run both)
  VLLM_PLUGINS              vLLM's own: a list without "logits_processor" keeps the plugin out
  LOGITS_PROCESSOR_ALLOW_UNTESTED_VLLM=1   start on a vLLM version this plugin was not tested on

`stats()` returns, in the process that samples, how many batches the package sampled and how
many fell back to vLLM's sampler, per reason; `LLM.collective_rpc("logits_processor_stats")`
returns the same from each worker process.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from typing import Any, Optional

from . import _kernel

__all__ = ["register", "stats", "shadow_records", "SUPPORTED_VLLM", "KernelSettingError"]

KernelSettingError = _kernel.KernelSettingError
SUPPORTED_VLLM = ("0.32.",)  # version prefixes this plugin is tested on
_installed = False
_runners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # model runners sampling through the package


class UnsupportedVLLMError(RuntimeError):
    pass


def _check_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.startswith(SUPPORTED_VLLM) or os.environ.get("LOGITS_PROCESSOR_ALLOW_UNTESTED_VLLM") == "1":
        return
    raise UnsupportedVLLMError(
        f"vllm_logits_processor: vLLM {version} is not supported (tested: {', '.join(v + 'x' for v in SUPPORTED_VLLM)}); "
        "install a supported vLLM, keep the plugin out with VLLM_PLUGINS, or set "
        "LOGITS_PROCESSOR_ALLOW_UNTESTED_VLLM=1")


def register() -> None:
    """The `vllm.general_plugins` entry point: called by vLLM in each of its processes."""
    _check_version()
    _kernel.resolve()  # a wrong LOGITS_PROCESSOR_KERNEL fails here, at engine start, naming it
    _install()


def _enabled() -> bool:
    value = os.environ.get("LOGITS_PROCESSOR_SAMPLER", "on").strip().lower()
    if value not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"LOGITS_PROCESSOR_SAMPLER={value!r}: expected on or off")
    return value in ("on", "1", "true")


def _seed_base(runner) -> int:
    seed = getattr(runner.model_config, "seed", None)
    material = os.urandom(8) if seed is None else f"vllm_logits_processor/{seed}".encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")


def _install() -> None:
    global _installed
    if _installed:
        return
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_class = gmr.GPUModelRunner
    for name in ("__init__", "_sample"):
        if not hasattr(runner_class, name):
            raise UnsupportedVLLMError(f"vllm_logits_processor: GPUModelRunner.{name} is missing in this vLLM")
    if not callable(getattr(gmr, "apply_grammar_bitmask", None)):
        raise UnsupportedVLLMError("vllm_logits_processor: gpu_model_runner.apply_grammar_bitmask is missing")

    original_init = runner_class.__init__
    original_sample = runner_class._sample
    original_grammar = gmr.apply_grammar_bitmask

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._lp_sampler = None
        if not _enabled() or self.is_pooling_model:
            return
        from vllm.logger import init_logger
        from vllm.platforms import current_platform

        from ._sampler import PackageSampler

        backend = "cpu" if current_platform.is_cpu() else None
        lp = _kernel.load(backend)
        self._lp_sampler = PackageSampler(lp, self.sampler, self.input_batch.vocab_size, self.device,
                                          _seed_base(self))
        _runners.add(self)
        kind, where = _kernel.resolve()
        init_logger("vllm_logits_processor").info(
            "logits-processor plugin: sampling through the %s kernel %s (%s)", kind, where, lp.__name__)

    def _sample(self, logits, spec_decode_metadata):
        plugin = getattr(self, "_lp_sampler", None)
        if plugin is None:
            return original_sample(self, logits, spec_decode_metadata)
        # As GPUModelRunner._sample: the async updates of the output (and draft) token ids first.
        self.input_batch.update_async_output_token_ids()
        sampling_metadata = self.input_batch.sampling_metadata
        if spec_decode_metadata is None:
            return plugin.forward(logits, sampling_metadata, self.input_batch)
        if self.use_async_scheduling and self._draft_token_req_ids is not None:
            draft_token_ids_cpu, _ = self._get_draft_token_ids_cpu()
            self.input_batch.update_async_spec_token_ids(draft_token_ids_cpu)
        draft_probs = self._get_spec_decode_draft_probs(spec_decode_metadata)
        output = plugin.forward_speculative(logits, sampling_metadata, self.input_batch, spec_decode_metadata,
                                            draft_probs)
        if output is None:  # counted and logged by the plugin
            output = self.rejection_sampler(spec_decode_metadata, draft_probs, logits, sampling_metadata)
        return output

    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        runner = next((r for r in list(_runners) if r.input_batch is input_batch), None)
        if runner is None or runner._lp_sampler is None:
            return original_grammar(scheduler_output, grammar_output, input_batch, logits)
        _apply_grammar_bitmask(runner._lp_sampler.lp, scheduler_output, grammar_output, input_batch, logits)

    runner_class.__init__ = __init__
    runner_class._sample = _sample
    _warn_on_model_runner_v2()
    gmr.apply_grammar_bitmask = apply_grammar_bitmask
    # LLM.collective_rpc("logits_processor_stats"): stats() of each worker, by name (a function
    # sent to the workers needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.logits_processor_stats = lambda self: stats()
    _installed = True


def _warn_on_model_runner_v2() -> None:
    """Model Runner V2 (vllm/v1/worker/gpu/model_runner.py, its sampler
    vllm/v1/worker/gpu/sample/sampler.py) is not hooked: say so when one is built, rather than
    let vLLM's own sampler run unannounced."""
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except Exception:  # not importable in this build: nothing to warn about
        return
    original = v2.GPUModelRunner.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _enabled():
            from vllm.logger import init_logger

            init_logger("vllm_logits_processor").warning(
                "logits-processor plugin: Model Runner V2 is not covered; vLLM's own sampler samples "
                "(VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner, which the plugin covers)")

    v2.GPUModelRunner.__init__ = __init__


def _apply_grammar_bitmask(lp, scheduler_output, grammar_output, input_batch, logits) -> None:
    """vllm/v1/structured_output/utils.py's apply_grammar_bitmask with the package's
    apply_token_bitmask_inplace instead of XGrammar's: the same reordering of the scheduler's
    compacted bitmask to the batch's rows, then the mask, in place (any logits dtype)."""
    import numpy as np
    import torch

    grammar_bitmask = grammar_output.grammar_bitmask
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    struct_out_req_ids = set(grammar_output.structured_output_request_ids)
    batch_indices: dict[str, int] = {}
    cumulative_offset = 0
    for batch_index, req_id in enumerate(input_batch.req_ids):
        logit_index = batch_index + cumulative_offset
        cumulative_offset += len(spec_tokens.get(req_id, ()))
        if req_id in struct_out_req_ids:
            batch_indices[req_id] = logit_index
    sorted_bitmask = np.full((logits.shape[0], grammar_bitmask.shape[1]), -1, dtype=grammar_bitmask.dtype)
    out_indices: list[int] = []
    cumulative_index = 0
    for req_id in grammar_output.structured_output_request_ids:
        num_spec_tokens = len(spec_tokens.get(req_id, ()))
        if (logit_index := batch_indices.get(req_id)) is not None:
            for i in range(1 + num_spec_tokens):
                sorted_bitmask[logit_index + i] = grammar_bitmask[cumulative_index + i]
                out_indices.append(logit_index + i)
        cumulative_index += 1 + num_spec_tokens
    bitmask = torch.from_numpy(sorted_bitmask).to(logits.device, non_blocking=True)
    indices: Optional[list[int]] = None if len(out_indices) == logits.shape[0] else out_indices
    lp.apply_token_bitmask_inplace(logits, bitmask, indices=indices)


def _sampler_of(runner) -> Any:
    return getattr(runner, "_lp_sampler", None)


def stats() -> list[dict[str, Any]]:
    """Per model runner in this process that samples through the package: batches, rows,
    seconds in the plugin's step, and the fallbacks to vLLM's sampler by reason."""
    return [s.snapshot() for s in (_sampler_of(r) for r in list(_runners)) if s is not None]


def shadow_records(worker=None) -> list[dict[str, Any]]:
    """With LOGITS_PROCESSOR_SHADOW=1 (tests): each step's output of the plugin and of vLLM's
    own sampler on the same logits and SamplingMetadata, for the runners of this process."""
    records = []
    for r in list(_runners):
        s = _sampler_of(r)
        if s is not None:
            records.extend(s.shadow_records)
    return records
