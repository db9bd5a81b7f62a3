"""Small helpers shared by several test files (tests/ is on sys.path, like reward_fixtures)."""

import torch


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


# fp32 gradients summed in another order (micro-batches, dp ranks, tp partial sums) differ by rounding only:
# each element accumulates at most ~10^3 products here (tokens x micro-batches x ranks), so its relative
# error stays below ~1e3 x eps_fp32 = 1.2e-4 of the tensor's scale. A real bug (a missing 1/dp, a dropped
# micro-batch, a wrong shard) moves gradients by O(1) of that scale. Parameters after an Adam step are NOT
# compared: Adam's first step is lr * g / (|g| + eps), which turns the rounding noise of near-zero
# gradients into lr-sized differences on some CPUs and not others.
GRAD_RTOL = 1e-3
GRAD_ATOL_OF_SCALE = 1e-4


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
