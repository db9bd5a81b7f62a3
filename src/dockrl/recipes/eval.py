"""Held-out evaluation: greedy answers scored by the reward functions.

accuracy = share of prompts whose answer a reward function marks correct (`<fn>/correct`); when no
function reports correctness, the share with total reward >= 1.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dockrl.checkpoint.directory import resolve_lora
from dockrl.checkpoint.inference import load_for_inference, vision_inputs
from dockrl.data.images import vision_processor
from dockrl.dock.columns import ENV_FAILED, ENV_REWARD, LOSS_MASK, RESPONSE_IDS
from dockrl.engines.rollout.sampler import SamplingParams, generate
from dockrl.models.tokenizer import Tokenizer
from dockrl.recipes.common import EncodedPrompt, encode_prompts
from dockrl.rewards.runner import RewardRunner, RewardSpec, accuracy_key


def score_answers(
    prompts: list[EncodedPrompt], responses: list[str], specs: list[RewardSpec], *, timeout_s: float = 5.0
) -> dict[str, Any]:
    """Score responses to held-out prompts; returns accuracy, mean reward and per-prompt records."""
    runner = RewardRunner(specs, timeout_s=timeout_s, num_processes=1)
    try:
        scores, components, _ = runner.score([p.text for p in prompts], responses, [p.label for p in prompts])
    finally:
        runner.close()
    key = accuracy_key(components)
    correct = components[key] if key else [float(s >= 1.0) for s in scores]
    return {
        "accuracy": statistics.fmean(correct),
        "reward_mean": statistics.fmean(scores),
        "num_prompts": len(prompts),
        "records": [
            {"prompt": p.text, "response": r, "label": str(p.label), "correct": c}
            for p, r, c in zip(prompts, responses, correct)
        ],
    }


def prompt_images(prompts: list[EncodedPrompt]) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
    """A vision model's prompts' images as the rollout takes them (uint8 patches, grid; zero images for a
    text row), None for a text model's prompts."""
    if not prompts or prompts[0].image_patches is None:
        return None
    return [(p.image_patches, p.image_grid_thw) for p in prompts]


def _evaluate_trajectories(
    model: Any,
    tokenizer: Tokenizer,
    prompts: list[EncodedPrompt],
    specs: list[RewardSpec],
    params: SamplingParams,
    pad: int,
    batch_size: int,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Greedy multi-turn answers (engines.rollout.multi_turn.run_trajectories), scored on the final turn."""
    from dockrl.engines.rollout.multi_turn import final_turn, run_trajectories
    from dockrl.engines.rollout.rollout_engine import RolloutEngine

    longest = max(len(p.ids) for p in prompts) + settings["limits"].max_response_tokens
    engine = RolloutEngine(
        model,
        num_slots=batch_size,
        max_seq_len=min(model.args.max_position_embeddings, longest),
        pad_token_id=pad,
        detokenize=tokenizer.decode,
    )
    try:
        outs, stats = run_trajectories(
            engine,
            [p.ids for p in prompts],
            [p.env_row or {} for p in prompts],
            params=params,
            groups_per_pull=batch_size,
            row_seed=lambda row: 0,
            **settings,
        )
    finally:
        settings["envs"].close()
    responses = [tokenizer.decode(final_turn(o["response_ids"], o["loss_mask"])) for o in outs]
    result = score_answers(prompts, responses, specs)
    trajectories = max(1, stats["env"]["trajectories"])
    result["tool_call_rate"] = stats["env"]["with_tool_calls"] / trajectories
    result["turns"] = stats["env"]["turns"] / trajectories
    return result


@torch.no_grad()
def evaluate_model_dir(
    model_path: str,
    data_path: str,
    specs: list[RewardSpec],
    *,
    prompt_field: str = "prompt",
    label_field: str = "answer",
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    max_prompt_len: int = 512,
    max_new_tokens: int = 64,
    limit: int | None = None,
    batch_size: int = 128,
    device: str = "cpu",
    env: Any = None,
) -> dict[str, Any]:
    """Load a model directory (or a checkpoint root's hf/ export, or a LoRA checkpoint root's base with its
    adapters merged) in this process and score greedy answers on a held-out file. With `env` (an EnvConfig
    whose name is set) each answer is a greedy multi-turn trajectory's final turn, and the result carries the
    share of trajectories that called a tool (`tool_call_rate`) and the mean turns."""
    model, tokenizer = load_for_inference(model_path, device=device)
    resolved_dir = resolve_lora(model_path)[0]
    make_env = settings = None
    if env is not None:
        from dockrl.config.specs import env_spec
        from dockrl.engines.rollout.dock_feed import env_settings, local_envs
        from dockrl.envs.loader import factory_of

        spec = env_spec(env, system_prompt, max_new_tokens)
        assert spec is not None, "evaluate_model_dir takes an env with its name set"
        settings = env_settings(spec, spec.max_response_tokens, tokenizer, model.args.family)
        settings["envs"] = local_envs(spec, model.args.family)
        make_env = factory_of(spec, model.args.family)
    prompts, _ = encode_prompts(
        data_path,
        tokenizer,
        prompt_field=prompt_field,
        label_field=label_field,
        system_prompt=system_prompt,
        use_chat_template=use_chat_template,
        max_prompt_len=max_prompt_len,
        limit=limit,
        make_env=make_env,
        processor=vision_processor(resolved_dir),  # a vision-language model's rows carry their images
        model_path=resolved_dir,
    )
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=[eos] if eos is not None else []
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    if settings is not None:
        return _evaluate_trajectories(model, tokenizer, prompts, specs, params, pad, batch_size, settings)
    outs = generate(
        model,
        [p.ids for p in prompts],
        params,
        [0] * len(prompts),
        pad_token_id=pad,
        max_batch_size=batch_size,
        vision=vision_inputs(model_path, model.args),
        images=prompt_images(prompts),
    )
    responses = [tokenizer.decode(o.token_ids.tolist()) for o in outs]
    return score_answers(prompts, responses, specs)


def evaluate_agent(
    model_path: str,
    data_path: str,
    agent: str,
    specs: list[RewardSpec],
    *,
    prompt_field: str = "prompt",
    label_field: str = "answer",
    max_new_tokens: int = 64,
    limit: int | None = None,
    device: str = "cpu",
    concurrency: int = 16,
    timeout_s: float = 300.0,
    temperature: float = 0.0,
    max_turns: int = 16,
) -> dict[str, Any]:
    """An agent function (serve/agents.py) held out, on the path a run trains it on: an AgentHost (its
    OpenAI-compatible server on loopback, a key of its own) in front of a rollout engine over the model, each
    sample's requests one trajectory, token in and token out (serve/agent_host.py), every turn sampled at
    `temperature` (0: greedy, as `dockrl eval`), at most `max_new_tokens` a request and `max_turns` requests a
    sample, `timeout_s` of the agent's own time between two requests. Its reward is what the agent returns, or,
    when it returns None, the reward functions' score of its final assistant turn. Returns the mean reward,
    accuracy (reward >= 1), failed samples, requests per sample and per-row records."""
    import math

    from dockrl.data.datasets import load_prompts
    from dockrl.engines.rollout.multi_turn import (
        ChatDelta,
        TurnLimits,
        final_turn,
        run_trajectories,
        turn_runs,
    )
    from dockrl.engines.rollout.rollout_engine import RolloutEngine
    from dockrl.envs.host import LocalEnvs
    from dockrl.models.tokenizer import stop_token_ids
    from dockrl.serve.agent_host import AgentHost
    from dockrl.serve.agents import load_agent
    from dockrl.serve.model_server import DEFAULT_MAX_SEQ_LEN

    solve = load_agent(agent)
    records = load_prompts(data_path, prompt_field=prompt_field, label_field=label_field, limit=limit)
    rows = [{"prompt": r.prompt, "label": r.label} for r in records]
    model, tokenizer = load_for_inference(model_path, device=device)
    stops = stop_token_ids(tokenizer.eos_token_id, model.args.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    max_seq_len = min(model.args.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    engine = RolloutEngine(
        model, num_slots=concurrency, max_seq_len=max_seq_len, pad_token_id=pad, detokenize=tokenizer.decode
    )
    host = AgentHost(
        solve,
        tokenizer,
        model.args.family,
        stop_token_ids=stops,
        vocab_size=model.args.vocab_size,
        max_seq_len=max_seq_len,
        max_tokens=max_new_tokens,
    )
    try:
        outs, _ = run_trajectories(
            engine,
            [
                tokenizer.encode(str(row["prompt"])) or [pad] for row in rows
            ],  # the agent's first request replaces it
            rows,
            params=SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stops
            ),
            groups_per_pull=concurrency,
            row_seed=lambda row: row,
            envs=LocalEnvs(host),
            delta=ChatDelta(tokenizer, []),
            system_prompt=None,
            limits=TurnLimits(max_turns, 1 << 30, max_seq_len, timeout_s),
        )
    finally:
        host.close()
    finals = [
        tokenizer.decode(final_turn(o[RESPONSE_IDS], o[LOSS_MASK]), skip_special_tokens=True) for o in outs
    ]
    failed = [float(o[ENV_FAILED]) > 0 for o in outs]
    returned = [float(o[ENV_REWARD]) for o in outs]
    unscored = [i for i, r in enumerate(returned) if math.isnan(r) and not failed[i]]
    scores = {i: 0.0 for i in range(len(outs)) if failed[i]}
    scores.update({i: r for i, r in enumerate(returned) if not math.isnan(r) and not failed[i]})
    if unscored:
        runner = RewardRunner(specs, timeout_s=5.0, num_processes=1)
        try:
            scored, _, _ = runner.score(
                [str(rows[i]["prompt"]) for i in unscored],
                [finals[i] for i in unscored],
                [rows[i]["label"] for i in unscored],
            )
        finally:
            runner.close()
        scores.update(zip(unscored, scored))
    rewards = [scores[i] for i in range(len(outs))]
    requests = [sum(policy for policy, _ in turn_runs(o[RESPONSE_IDS], o[LOSS_MASK])) for o in outs]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "accuracy": statistics.fmean(float(r >= 1.0) for r in rewards) if rewards else 0.0,
        "num_prompts": len(outs),
        "failed": sum(failed),
        "requests_per_sample": statistics.fmean(requests) if requests else 0.0,
        "records": [
            {
                "prompt": str(row["prompt"]),
                "label": str(row["label"]),
                "reward": reward,
                "final": final,
                "requests": n,
                "failed": "the agent raised (or its environment worker failed)" if bad else None,
            }
            for row, reward, final, n, bad in zip(rows, rewards, finals, requests, failed)
        ],
    }
