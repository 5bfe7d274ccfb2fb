import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def low_rank_plus_noise(n: int, d_out: int, d_in: int, rank: int, noise: float, dtype=torch.float64) -> torch.Tensor:
    """N task vectors sharing a rank-`rank` row space plus i.i.d. noise (the paper's signal + proxy-noise picture)."""
    rows = torch.randn(rank, d_in, dtype=dtype)
    return torch.randn(n, d_out, rank, dtype=dtype) @ rows + noise * torch.randn(n, d_out, d_in, dtype=dtype)
