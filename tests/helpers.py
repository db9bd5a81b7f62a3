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
