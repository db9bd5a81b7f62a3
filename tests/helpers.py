"""Small helpers shared by several test files (tests/ is on sys.path, like reward_fixtures)."""

import torch

from dockrl.dock.columns import check_get, check_put
from dockrl.models import ModelArgs, Transformer


def close(actual, expected, atol=1e-5):
    """assert_close in fp32 against hand-computed numbers, absolute tolerance only."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


def perturb_(module: torch.nn.Module, seed: int) -> None:
    """Distinct random values in every parameter (norm weights and biases too), so a mis-loaded one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


# dockrl's logits against transformers' on the same fp32 weights: the decoder parity bound of
# tests/unit/test_decoder.py::test_logits_match_transformers (other kernels, other summation order). The adapters add
# the same two matmuls (x A^T, then B) on both sides, so the bound carries over unchanged.
PARITY_BOUND = 1e-4  # LoRA parity with PEFT/transformers (tests/unit/test_lora.py, e2e/test_lora_run.py)


# fp32 gradients summed in another order (micro-batches, dp ranks, tp partial sums) differ by rounding only:
# each element accumulates at most ~10^3 products here (tokens x micro-batches x ranks), so its relative
# error stays below ~1e3 x eps_fp32 = 1.2e-4 of the tensor's scale. A real bug (a missing 1/dp, a dropped
# micro-batch, a wrong shard) moves gradients by O(1) of that scale. Parameters after an Adam step are NOT
# compared: Adam's first step is lr * g / (|g| + eps), which turns the rounding noise of near-zero
# gradients into lr-sized differences on some CPUs and not others.
GRAD_RTOL = 1e-3
GRAD_ATOL_OF_SCALE = 1e-4


def fsdp_unit_count(model: torch.nn.Module) -> int:
    """FSDP2 units of `model`: the modules fully_shard was applied to, a group of modules counted once."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return len({id(fully_shard.state(m)) for m in model.modules() if isinstance(m, FSDPModule)})


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient after `engine.train_step` (a collective under FSDP / tp)."""
    from dockrl.parallel.layout import full_tensor

    return {
        name: full_tensor(param.grad, engine.placement(name)).detach().clone()
        for name, param in engine.model.named_parameters()
    }


def assert_grads_close(actual: dict, expected: dict, msg=None) -> None:
    """Gradients equal up to fp32 reassociation (see GRAD_RTOL): per tensor, atol scales with its max."""
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        scale = float(ref.abs().max())
        assert scale > 0, f"{name}: no gradient reached this parameter"
        torch.testing.assert_close(
            actual[name], ref, rtol=GRAD_RTOL, atol=GRAD_ATOL_OF_SCALE * scale, msg=(msg, name)
        )


class FakeDock:
    """DockClient's get/put over a table of whole groups; each consumer gets every row once, in order."""

    def __init__(self, columns: dict[str, list], group_size: int) -> None:
        self.table = [dict(zip(columns, values)) for values in zip(*columns.values())]
        self.group_size = group_size
        self.served: dict[str, int] = {}
        self.pulls: list[tuple[str, list[int]]] = []

    def get(self, consumer, columns, count, *, whole_groups, min_count):
        check_get(consumer, columns)  # the real clients' schema check
        assert whole_groups and min_count == self.group_size and count % self.group_size == 0
        start = self.served.get(consumer, 0)
        if start == len(self.table):
            return None
        rows = list(range(start, min(start + count, len(self.table))))
        # The real dock waits until the columns are ready; this table has them from the start.
        assert all(c in self.table[r] for r in rows for c in columns), "column not ready"
        self.served[consumer] = rows[-1] + 1
        self.pulls.append((consumer, rows))
        return rows, {c: [self.table[r][c] for r in rows] for c in columns}

    def put(self, producer, rows, batch):
        check_put(producer, batch)  # the real clients' schema check
        for column, values in batch.items():
            for row, value in zip(rows, values):
                assert column not in self.table[row], f"{column} of row {row} written twice"
                self.table[row][column] = value


def tiny_decoder(max_position_embeddings: int) -> Transformer:
    """The rollout engine tests' decoder: a 2-layer Qwen2-shaped model (vocabulary 96, hidden 32, GQA 4/2 heads),
    random weights of seed 0 at std 0.1, in eval mode."""
    args = ModelArgs(
        family="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        max_position_embeddings=max_position_embeddings,
    )
    model = Transformer(args)
    model.init_weights(seed=0, std=0.1)
    return model.eval()


def scaling_model_args(size: str) -> ModelArgs:
    """`dockrl bench scaling`'s model of that size (scaling.SIZES): qwen2, its 8,000-row tied head, positions for
    a 64-token prompt and 2,048 response tokens."""
    from dockrl.bench.scaling import SIZES

    hidden, layers, heads, kv_heads, mlp = SIZES[size]
    return ModelArgs(
        family="qwen2",
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=64 + 2048,
    )
