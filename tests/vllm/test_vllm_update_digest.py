"""The weight digest sees RL-sized updates: after one real GRPO step (full fine-tuning at lr 1e-6, LoRA at lr 1e-3)
an engine that skipped one module's reload, or kept the LM head's old packed copy, fails with WeightSyncError,
while the log-prob probe with its bound stays blind to the same engine (engines/rollout/vllm_digest.py)."""

import pytest
import torch

from dockrl.algos.logprobs import token_logprobs
from dockrl.algos.losses import policy_loss
from dockrl.engines.rollout import vllm_backend
from dockrl.engines.rollout.sampler import generate_with
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.engines.rollout.vllm_backend import (
    PROBE_TOL,
    VllmBackend,
    VllmSettings,
    WeightSyncError,
    probe_ids,
)
from dockrl.models.hf import load_model, read_config
from dockrl.models.lora import LoraSpec, adapter_state, apply_lora, lora_layers, merge_into, resolve_targets

PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 200, 3], [44, 45, 46], [300, 2, 11, 12, 13, 14, 15]]
GROUP = 8  # samples per prompt
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0)
DROPPED = "model.layers.1.mlp.down_proj.weight"  # the module whose reload the broken engines skip


@pytest.fixture(scope="module")
def engine(vllm_model):
    """One fp32 engine for the module (building one takes ~10 s on a CPU)."""
    args = read_config(vllm_model)
    settings = VllmSettings(
        model_dir=str(vllm_model),
        dtype=torch.float32,
        max_model_len=128,
        max_num_seqs=GROUP * len(PROMPTS),
        memory_utilization=0.05,
        kv_cache_bytes=vllm_backend.kv_cache_bytes(args, GROUP * len(PROMPTS), 128, torch.float32),
    )
    built = VllmBackend(settings)
    yield built
    built.close()


def _hf_weights(model) -> dict[str, torch.Tensor]:
    """What the switch streams: each parameter under its Hugging Face name, LoRA adapters merged (W + s B A)."""
    adapters = adapter_state(model)
    scaling = next((layer.lora_scaling for _, layer in lora_layers(model)), 1.0)
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name] = merge_into(name, tensor.detach().clone(), adapters, scaling)
    return out


def _probe_reference(model) -> torch.Tensor:
    """The trainer's log-probs of the probe sequence (what it sends with an update)."""
    ids = probe_ids(model.args.vocab_size)
    with torch.no_grad():
        logits = model(ids[None])[0, :-1].float()
    return token_logprobs(logits, ids[1:])


def _grpo_step(model, engine, lr: float) -> float:
    """One GRPO step on the engine's samples: reward = share of a response's tokens below vocab / 2, advantages
    normalised within each prompt's group, the project's clipped loss, one AdamW step at `lr`; returns the
    spread of the advantages (0 would be no step at all)."""
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    outs = generate_with(engine, prompts, SAMPLED, list(range(len(prompts))))
    half = model.args.vocab_size // 2
    rewards = torch.tensor([float((o.token_ids < half).float().mean()) for o in outs]).view(
        len(PROMPTS), GROUP
    )
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    width = max(len(o.token_ids) for o in outs)
    logprobs = torch.zeros(len(outs), width)
    mask = torch.zeros(len(outs), width)
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        ids = torch.tensor(prompt + out.token_ids.tolist())
        logits = model(ids[None])[0, len(prompt) - 1 : -1].float()
        logprobs[row, : len(out.token_ids)] = token_logprobs(logits, out.token_ids)
        mask[row, : len(out.token_ids)] = 1
    loss = policy_loss(logprobs, logprobs.detach(), advantages, mask).loss
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    loss.backward()
    optimizer.step()
    return float(advantages.abs().max())


def _skipping(engine, name: str):
    """The engine's reload with `name` dropped from the stream after the trainer's digest recorded it: a
    loader that skipped one module."""
    reload = engine._reload
    return lambda pairs: reload((n, t) for n, t in pairs if n != name)


# The probe bound each case is blind under: full fine-tuning's step hides under even the fp32 bound (1e-3); the
# LoRA step's stale module moves the probe by ~1e-2 per token, which the fp32 bound sees but the bf16 bound
# (5e-2, the dtype of real runs) does not.
@pytest.mark.parametrize(
    "lora, lr, old_bound",
    [(False, 1e-6, PROBE_TOL[torch.float32]), (True, 1e-3, PROBE_TOL[torch.bfloat16])],
    ids=["full-lr1e-6", "lora-lr1e-3"],
)
def test_a_module_left_stale_by_one_rl_step_is_caught_by_the_digest_not_by_the_probe(
    vllm_model, engine, monkeypatch, lora, lr, old_bound
):
    model = load_model(vllm_model).eval()
    if lora:
        apply_lora(
            model,
            LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=resolve_targets("all-linear")),
            seed=0,
        )
    before = _hf_weights(model)
    reference_before = _probe_reference(model)
    engine.load_weights(before.items(), reference_before)  # the engine holds the policy that samples
    assert _grpo_step(model, engine, lr) > 0.5  # groups with different rewards: a real update
    after = _hf_weights(model)
    reference_after = _probe_reference(model)
    moved = float((reference_after - reference_before).abs().mean())  # the trainer's own move per probe token
    changed = float((after[DROPPED] - before[DROPPED]).abs().max())
    assert changed > 0

    # one module's reload skipped: the digest names it ...
    monkeypatch.setattr(engine, "_reload", _skipping(engine, DROPPED))
    with pytest.raises(
        WeightSyncError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: its kernel multiplies"
    ):
        engine.load_weights(after.items(), reference_after)
    # ... which the probe alone, with its bound, let through
    stale_diff = float((engine.probe_logprobs(engine.probe_ids()) - reference_after).abs().mean())
    assert stale_diff <= old_bound
    monkeypatch.undo()

    # every module reloaded: the digest and the probe pass
    report = engine.load_weights(after.items(), reference_after)
    assert report["digest_tensors"] == len(after) and report["probe_abs_diff"] < 1e-5
    print(f"lora={lora} lr={lr:g}: trainer moved {moved:.3g}/token; stale probe diff {stale_diff:.3g}")


def test_a_stale_lm_head_pack_after_one_full_step_is_caught(vllm_model, engine, monkeypatch):
    """The vocabulary pack (the first bug of this class) after an RL-sized update: the LM head's packed copy
    keeps the old embedding, which only its kernel columns show."""
    model = load_model(vllm_model).eval()
    engine.load_weights(_hf_weights(model).items(), _probe_reference(model))
    _grpo_step(model, engine, 1e-6)
    after, reference_after = _hf_weights(model), _probe_reference(model)
    monkeypatch.setattr(vllm_backend, "_repack_vocab", lambda worker: 0)
    with pytest.raises(WeightSyncError, match=r"lm_head\.weight: its kernel multiplies"):
        engine.load_weights(after.items(), reference_after)
    stale_diff = float((engine.probe_logprobs(engine.probe_ids()) - reference_after).abs().mean())
    assert stale_diff <= PROBE_TOL[torch.float32]
    monkeypatch.undo()
    engine.load_weights(after.items(), reference_after)
    print(f"stale LM head pack after a full step at lr 1e-6: probe diff {stale_diff:.3g}")
