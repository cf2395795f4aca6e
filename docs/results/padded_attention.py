"""Does attention over the main network's pad chunks cost the policy its share of a step? The small
benchmark shape's main network (6 layers, 384 wide, 6 heads), forward and backward over 8 rows of
98-119 chunks packed as the model packs them (megatok.model.blocks.Packed), with attention over the
padded [B, K] rows (the model's way) against attention row by row at each row's own length (no pads).
One thread, process CPU time, the two interleaved; prints the medians and the largest output difference.

    python docs/results/padded_attention.py [--rounds 16]
"""

import argparse
import statistics
import time

import torch

from megatok.model import blocks
from megatok.model.blocks import Packed, Stack, apply_rotary, attention


def row_by_row(self, x, cos, sin, mask=None, kv=None, packed=None):
    """Attention.forward for packed rows without pads: each row's real chunks alone, causal."""
    qkv, D, out, start = self.qkv(x), self.qkv.out_features // 3, [], 0
    for b, n in enumerate(packed.lengths):
        r = qkv[start:start + n].view(1, n, 3, self.n_heads, D // self.n_heads)
        q, k = apply_rotary(r[:, :, :2], cos[b:b + 1, :n], sin[b:b + 1, :n]).transpose(1, 3).unbind(2)
        out.append(attention(q, k, r[:, :, 2].transpose(1, 2)).transpose(1, 2).reshape(n, D))
        start += n
    return self.out(torch.cat(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lengths = [119, 100, 104, 98, 110, 101, 107, 99]  # a policy batch's chunk counts at 8 x 512 bytes
    B, K, d = len(lengths), max(lengths), 384
    stack = Stack(6, d, 6, 1024, eps=1e-5, theta=10000.0)
    positions = torch.arange(K)[None].expand(B, K) * 5
    rows = torch.cat([b * K + torch.arange(n) for b, n in enumerate(lengths)])
    Packed.lengths = lengths  # read by row_by_row
    x0 = torch.randn(B, K, d)
    padded_forward = blocks.Attention.forward

    def step(forward):
        blocks.Attention.forward = forward
        x = x0.clone().requires_grad_()
        stack.zero_grad()
        t0 = time.process_time()
        y = stack(x, positions, rows=rows)
        y.sum().backward()
        return time.process_time() - t0, y.detach()

    times = {"padded": [], "row by row": []}
    for _ in range(args.rounds):
        for name, forward in (("padded", padded_forward), ("row by row", row_by_row)):
            times[name].append(step(forward)[0])
    diff = (step(padded_forward)[1] - step(row_by_row)[1]).abs().max().item()
    blocks.Attention.forward = padded_forward
    for name, t in times.items():
        print(f"{name}: {statistics.median(t[2:]):.3f} s (median of {len(t) - 2} rounds after 2 warm-up)")
    print(f"largest output difference: {diff:.1e}")


if __name__ == "__main__":
    main()
