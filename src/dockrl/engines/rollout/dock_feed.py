"""Serve rollout rows from the transfer dock through a RolloutEngine, pulling and writing back incrementally.

```
 loop:
   while the engine has room for a whole group and the dock may still have rows:
       pull up to min(groups_per_pull, free slots / group) whole groups of prompt_ids
         (blocking only when the engine is idle; otherwise a single non-blocking poll)
       rows with the same prompt (one group) -> one Request: one prefill, n samples, one seed per row
   engine.step()  -> samples finished this step -> put response_ids / rollout_logprobs for their rows
 until the dock says every row was served and the engine is empty
```

Rows are written back the step they finish, so reward workers (which pull whole groups) start on early
groups while later ones still generate. The client is passed in (anything with DockClient's `get` and
`put`, a DockAPI), so tests drive this loop with a fake.

Partial rollout (rollout.partial, `Partial` here) gives each response a token budget per pass:
```
 carried rows first (partial_ids ready: cut in an earlier step) -> one Request each: prompt + its tokens so
   far, budget = partial tokens, or the rest up to max_new_tokens on its last allowed pass
 then new groups as above, budget = partial tokens
 a sample that ends within its budget   -> response_ids / rollout_logprobs / policy_version (prefix + new)
 a sample cut at its budget             -> partial_ids / partial_logprobs / partial_versions, row reported
```
The driver then takes the groups of cut rows out of the step (their finished rows too) and the dock keeps
them for the next step (DockController.reset(keep_unfinished=response_ids, served_by=Stage.ROLLOUT)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dockrl.config.specs import EnvSpec, Partial, RolloutSpec
from dockrl.dock.api import DockAPI
from dockrl.dock.columns import (
    IMAGE_GRID_THW,
    IMAGE_PATCHES,
    PARTIAL_IDS,
    PARTIAL_LOGPROBS,
    PARTIAL_VERSIONS,
    POLICY_VERSION,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
    ROUTED_EXPERTS,
)
from dockrl.dock.errors import DockTimeoutError
from dockrl.dock.stages import Stage
from dockrl.engines.rollout.backend import RolloutBackend
from dockrl.engines.rollout.requests import Completion, Request, same_images
from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.envs.host import EnvCalls

ROLLOUT = Stage.ROLLOUT  # the stage this loop reads and writes the dock as


CARRIED = [PROMPT_IDS, PARTIAL_IDS, PARTIAL_LOGPROBS, PARTIAL_VERSIONS]  # what a carried row is served with


def row_seed(run_seed: int, step: int, row: int) -> int:
    """Per-row sampling seed: independent of which rank serves the row or what else is in its batch."""
    return (run_seed * 1_000_003 + step * 100_003 + row * 7919) % (2**63 - 1)


def step_engine(
    model: Any, spec: RolloutSpec, pad_token_id: int, detokenize: Callable, vision: Any = None
) -> RolloutEngine:
    """dockrl's continuous-batching engine for a run's rollout: rollout.max_batch_size slots, sequences up to the
    longest prompt and the response budget (within the model's positions), a KV cache laid out as
    rollout.kv_cache says, of at most rollout.kv_cache_tokens positions; `vision` a vision model's
    VisionInputs."""
    return RolloutEngine(
        model,
        num_slots=spec.max_batch_size,
        max_seq_len=min(model.args.max_position_embeddings, spec.max_seq_len),
        kv_cache=spec.kv_cache,
        kv_cache_tokens=spec.kv_cache_tokens,
        pad_token_id=pad_token_id,
        detokenize=detokenize,
        record_routes=spec.env is None,  # MoE single-turn: each row's experts go to routed_experts
        vision=vision,
        pack_weights=spec.pack_weights,
        native_kernels=spec.native_kernels,
    )


def serve_step(
    engine: RolloutBackend,
    client: DockAPI,
    spec: RolloutSpec,
    step: int,
    stop_token_ids: list[int],
    version: int,
    tokenizer: Any = None,
    family: str = "qwen2",
    envs: EnvCalls | None = None,
) -> dict:
    """Roll out every row of step `step` from the dock with the run's sampling settings and its per-row seeds,
    with the weights after `version` updates (each token's `policy_version`); what colocated actor ranks and
    separate rollout replicas both run. With an environment (spec.env), multi-turn trajectories
    (engines.rollout.multi_turn; `tokenizer` renders the observations, `family` parses tool calls, `envs` runs
    the environment calls: the run's environment workers, or None for environments in this process)."""
    params = SamplingParams(
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        stop_token_ids=stop_token_ids,
        stop_strings=list(spec.stop_strings),
    )
    if spec.env is not None:
        return _serve_env(engine, client, spec, spec.env, step, params, version, tokenizer, family, envs)
    return serve_from_dock(
        engine,
        client,
        consumer=ROLLOUT,
        params=params,
        group_size=spec.samples_per_prompt,
        groups_per_pull=spec.groups_per_pull,
        row_seed=lambda row: row_seed(spec.seed, step, row),
        version=version,
        partial=spec.partial,
        max_rows=spec.share_rows,
    )


def _serve_env(
    engine: RolloutBackend,
    client: DockAPI,
    spec: RolloutSpec,
    env: EnvSpec,
    step: int,
    params: SamplingParams,
    version: int,
    tokenizer: Any,
    family: str,
    envs: EnvCalls | None,
) -> dict:
    """serve_step's multi-turn branch: the run's environment, limits and chat template."""
    from dockrl.engines.rollout.multi_turn import serve_multi_turn

    assert tokenizer is not None, "multi-turn rollout renders observations with the tokenizer"
    settings = env_settings(env, spec.response_budget, tokenizer, family)
    own = envs is None
    if envs is None:
        envs = local_envs(env, family)
    try:
        return serve_multi_turn(
            engine,
            client,
            consumer=ROLLOUT,
            params=params,
            group_size=spec.samples_per_prompt,
            groups_per_pull=spec.groups_per_pull,
            row_seed=lambda row: row_seed(spec.seed, step, row),
            version=version,
            max_rows=spec.share_rows,
            envs=envs,
            keep_kv=spec.keep_kv_across_turns,
            **settings,
        )
    finally:
        if own:
            envs.close()


def env_settings(env: EnvSpec, budget: int, tokenizer: Any, family: str) -> dict:
    """serve_multi_turn's environment settings but the calls: the chat template's delta with the environment's
    tools, the system prompt and the limits (`budget`: the trajectory's tokens)."""
    from dockrl.engines.rollout.multi_turn import ChatDelta, TurnLimits
    from dockrl.envs.loader import env_tools, factory_of, is_agent

    tools = [] if is_agent(env) else env_tools(factory_of(env, family)())  # an agent renders its own requests
    return {
        "delta": ChatDelta(tokenizer, tools),
        "system_prompt": env.system_prompt,
        "limits": TurnLimits(env.max_turns, env.max_tool_calls, budget, env.call_timeout_s),
    }


def local_envs(env: EnvSpec, family: str) -> EnvCalls:
    """The run's environments in this process, env.concurrency calls at a time (held-out evaluation, and rollouts
    without environment workers)."""
    from dockrl.envs.host import EnvHost, LocalEnvs
    from dockrl.envs.loader import factory_of, is_agent

    if is_agent(env):
        raise ValueError(
            f"env.name={env.name!r} is an agent function: agents run on the environment tier (env.num_workers)"
        )
    return LocalEnvs(EnvHost(factory_of(env, family), env.concurrency))


def serve_from_dock(
    engine: RolloutBackend,
    client: DockAPI,
    *,
    consumer: Stage,
    params: SamplingParams,
    group_size: int,
    groups_per_pull: int,
    row_seed: Callable[[int], int],
    version: int | None = None,
    partial: Partial | None = None,
    max_rows: int | None = None,
) -> dict[str, Any]:
    """Generate a response for every row `consumer` gets from the dock (and puts as); returns lengths and
    counts.

    row_seed(row) gives each row's sampling seed, so a row's response does not depend on which rank or
    batch serves it. With `version`, each response token's policy_version is put beside it. With `partial`
    (and a version), responses get a token budget per pass and carried rows are continued (module docstring);
    "interrupted" lists the rows cut this pass. `max_rows`: the most rows this engine holds at once (its
    share of the step, RolloutSpec.share_rows), so the first replica to pull cannot take every group of a
    small step while the others idle; rows it finishes make room for more (None: no cap).
    """
    exhausted = False
    lengths: list[int] = []
    truncated = 0
    num_puts = 0
    carried = partial is not None  # carried rows may be waiting: served before new groups
    prefixes: dict[int, _Sample] = {}  # carried row -> what it had generated before this pass
    interrupted: list[int] = []
    held = 0  # rows pulled and not yet put back
    if partial is not None:
        assert version is not None, "partial rollout needs the pass's policy version"
        params = dataclasses.replace(params, max_new_tokens=partial.budget(0, 0))

    def room() -> int:
        """Rows this engine may pull now: its free slots, within its share."""
        free = engine.num_free_slots()
        return free if max_rows is None else min(free, max_rows - held)

    while True:
        while carried and not exhausted and room() >= 1:
            status, got = _pull_carried(client, consumer, room())
            if status == "done":
                exhausted = True
            if got is None:
                carried = False
                break
            for request, prefix in _continuations(*got, params, partial, row_seed):
                prefixes[request.tag[0]] = prefix
                engine.add(request)
                held += len(request.seeds)
        while not carried and not exhausted and room() >= group_size:
            num_groups = min(groups_per_pull, room() // group_size)
            status, got = _pull(
                client, consumer, num_groups * group_size, group_size, engine.has_work(), _has_vision(engine)
            )
            if status == "done":
                exhausted = True
            if got is None:
                break
            for request in _requests(*got, params, group_size, row_seed):
                engine.add(request)
                held += len(request.seeds)
        if not engine.has_work():
            break
        completions = engine.step()
        if completions:
            finished, cut = _split(completions, prefixes, version, partial)
            held -= len(finished) + len(cut)
            _put(client, consumer, finished, RESPONSE_IDS, ROLLOUT_LOGPROBS, POLICY_VERSION)
            _put(client, consumer, cut, PARTIAL_IDS, PARTIAL_LOGPROBS, PARTIAL_VERSIONS)
            num_puts += 1
            interrupted += [out.row for out in cut]
            lengths += [len(out.ids) for out in finished]
            truncated += sum(out.reason == "length" for out in finished)
    return {
        "response_lengths": lengths,
        "truncated": truncated,
        "puts": num_puts,
        "interrupted": interrupted,
        "continued": len(prefixes),
        **engine.stats,
    }


def _has_vision(engine: RolloutBackend) -> bool:
    """Whether the engine's model reads images (a RolloutEngine with VisionInputs): its rows' image columns are
    pulled with the prompts."""
    return getattr(engine, "vision", None) is not None


def _pull(
    client: DockAPI, consumer: Stage, count: int, group_size: int, busy: bool, images: bool = False
) -> tuple[str, tuple[list[int], dict[str, list]] | None]:
    """("rows", got), ("done", None) once every row was served, or ("later", None) when a busy engine's
    poll found nothing ready yet (it keeps decoding and asks again next step). `images`: the rows' image
    columns too."""
    try:
        got = client.get(
            consumer,
            [PROMPT_IDS, IMAGE_PATCHES, IMAGE_GRID_THW] if images else [PROMPT_IDS],
            count,
            whole_groups=True,
            min_count=group_size,
            timeout_s=0.0 if busy else None,
        )
    except DockTimeoutError:
        if busy:
            return "later", None
        raise
    return ("done", None) if got is None else ("rows", got)


def _requests(
    rows: list[int],
    batch: dict[str, list],
    params: SamplingParams,
    group_size: int,
    row_seed: Callable[[int], int],
) -> list[Request]:
    """Consecutive rows with the same prompt (at most group_size) become one Request tagged by its rows; a
    vision model's rows carry their images (a group's rows hold the same ones)."""
    requests: list[Request] = []
    previous: list[int] | None = None
    for i, (row, prompt_ids) in enumerate(zip(rows, batch[PROMPT_IDS])):
        prompt = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        images = (batch[IMAGE_PATCHES][i], batch[IMAGE_GRID_THW][i]) if IMAGE_PATCHES in batch else None
        same = requests and prompt == previous and same_images(requests[-1].images, images)
        if same and len(requests[-1].seeds) < group_size:
            requests[-1].seeds.append(row_seed(row))
            requests[-1].tag.append(row)
        else:
            requests.append(Request(prompt, [row_seed(row)], params, tag=[row], images=images))
        previous = prompt
    return requests


@dataclass
class _Sample:
    """A row's response so far: tokens, their log-probs and versions (None without a version), and why its
    sampling ended this pass."""

    row: int
    ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor | None
    reason: str
    routes: torch.Tensor | None = None  # MoE: the experts of every fed token (RolloutEngine record_routes)


def _pull_carried(
    client: DockAPI, consumer: Stage, count: int
) -> tuple[str, tuple[list[int], dict[str, list]] | None]:
    """("rows", got) for up to `count` carried rows, ("done", None) once every row was served, or ("none",
    None) when no carried row is left (they are all ready when the pass starts: a single poll tells)."""
    try:
        got = client.get(consumer, CARRIED, count, min_count=1, timeout_s=0.0)
    except DockTimeoutError:
        return "none", None
    return ("done", None) if got is None else ("rows", got)


def _continuations(
    rows: list[int],
    batch: dict[str, list],
    params: SamplingParams,
    partial: Partial | None,
    row_seed: Callable[[int], int],
) -> list[tuple[Request, _Sample]]:
    """One Request per carried row: its prompt followed by its tokens so far, with this pass's budget."""
    assert partial is not None
    out = []
    for i, row in enumerate(rows):
        ids = torch.as_tensor(batch[PARTIAL_IDS][i], dtype=torch.int64)
        versions = torch.as_tensor(batch[PARTIAL_VERSIONS][i], dtype=torch.int64)
        logprobs = torch.as_tensor(batch[PARTIAL_LOGPROBS][i], dtype=torch.float32)
        cuts = int(torch.unique(versions).numel())  # one pass per version, each ended by a cut
        budget = dataclasses.replace(params, max_new_tokens=partial.budget(len(ids), cuts))
        prompt = torch.as_tensor(batch[PROMPT_IDS][i]).tolist() + ids.tolist()
        out.append(
            (Request(prompt, [row_seed(row)], budget, tag=[row]), _Sample(row, ids, logprobs, versions, ""))
        )
    return out


def _split(
    completions: list[Completion], prefixes: dict[int, _Sample], version: int | None, partial: Partial | None
) -> tuple[list[_Sample], list[_Sample]]:
    """(finished samples, samples cut at their pass's budget), carried rows' tokens so far prepended."""
    finished: list[_Sample] = []
    cut: list[_Sample] = []
    for c in completions:
        gen, row = c.generation, c.tag[c.sample]
        ids, logprobs = gen.token_ids, gen.logprobs
        versions = None if version is None else torch.full((len(ids),), version, dtype=torch.int64)
        prefix = prefixes.get(row)
        if prefix is not None:
            # A carried row exists only under partial rollout, which versions every token.
            assert versions is not None and prefix.versions is not None
            ids, logprobs = torch.cat([prefix.ids, ids]), torch.cat([prefix.logprobs, logprobs])
            versions = torch.cat([prefix.versions, versions])
        # a continued row's generation saw its whole prefix as prompt: its routes cover every token already
        sample = _Sample(row, ids, logprobs, versions, gen.finish_reason, gen.routes)
        stopped_short = partial is not None and len(ids) < partial.max_new_tokens
        (cut if gen.finish_reason == "length" and stopped_short else finished).append(sample)
    return finished, cut


def _put(
    client: DockAPI, producer: Stage, samples: list[_Sample], ids: str, logprobs: str, versions: str
) -> None:
    """Write `samples` to the columns named (the response's, or a cut response's partial ones)."""
    if not samples:
        return
    batch: dict[str, list] = {ids: [s.ids for s in samples], logprobs: [s.logprobs for s in samples]}
    if samples[0].versions is not None:
        batch[versions] = [s.versions for s in samples]
    if ids == RESPONSE_IDS and samples[0].routes is not None:
        batch[ROUTED_EXPERTS] = [s.routes for s in samples]
    client.put(producer, [s.row for s in samples], batch)
