"""What the MoE kernel tests share (tests/kernels/test_moe*.py): `experts_case` (tokens, routing and expert weights
from one seed), `rel_rms`, and, on CPU, an interpreter fix for FP8: triton 3.6's
interpreter converts fp32 -> float8e4nv with its own bit arithmetic, which gets the exponent wrong for some values
(127.66 became 64 where the GPU and torch give 128), and reads e4m3 dot operands through the same path. Here both
directions go through torch's float8_e4m3fn conversion (round to nearest even, as the GPU's cvt does)."""
import numpy as np
import torch

if not torch.cuda.is_available():
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _Builder = _interp.InterpreterBuilder
    if not getattr(_Builder, "k3_fp8_fix", False):
        _fp_to_fp, _create_dot = _Builder.create_fp_to_fp, _Builder.create_dot

        def _e4m3_to_f32(data: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(torch.float8_e4m3fn)
            return t.float().numpy()

        def create_fp_to_fp(self, src, dst_type, rounding_mode, _orig=_fp_to_fp):
            s, d = src.dtype.scalar, dst_type.scalar
            if s == tl.float32 and d == tl.float8e4nv:
                t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
                return _interp.TensorHandle(t.view(torch.uint8).numpy(), tl.float8e4nv)
            if s == tl.float8e4nv and d == tl.float32:
                return _interp.TensorHandle(_e4m3_to_f32(src.data), tl.float32)
            return _orig(self, src, dst_type, rounding_mode)

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _orig=_create_dot):
            if a.dtype.scalar == tl.float8e4nv:
                a = _interp.TensorHandle(_e4m3_to_f32(a.data), tl.float32)
            if b.dtype.scalar == tl.float8e4nv:
                b = _interp.TensorHandle(_e4m3_to_f32(b.data), tl.float32)
            return _orig(self, a, b, d, input_precision, max_num_imprecise_acc)

        _Builder.create_fp_to_fp, _Builder.create_dot, _Builder.k3_fp8_fix = create_fp_to_fp, create_dot, True


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against b (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def random_ids(N, E, k, gen, device=DEV):
    """k distinct experts of E for each of N tokens."""
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(device)


def experts_case(N, L, I, E, k, dtype=torch.float32, seed=0, device=DEV):
    """(z [N, L], ids [N, k], gate weights [N, k], w1 / w3 [E, I, L], w2 [E, L, I]) with 1/sqrt(fan-in) weights."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=g).to(device, dtype)
    w1 = (torch.randn(E, I, L, generator=g) / L ** 0.5).to(device, dtype)
    w3 = (torch.randn(E, I, L, generator=g) / L ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, L, I, generator=g) / I ** 0.5).to(device, dtype)
    ids = random_ids(N, E, k, g, device)
    w = torch.rand(N, k, generator=g).to(device)
    return z, ids, w, w1, w3, w2
