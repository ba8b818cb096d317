"""A small training run under memfit.preemptible, driven by tests/preempt/test_preempt.py.

    python train_script.py DIR STEPS OUT [--pause-at K] [--reference REF] [--device cuda]

Trains STEPS steps (resuming from DIR), with dropout, an LR scheduler, a stateful sampler and
batches drawn from torch's, Python's and NumPy's RNGs (so every saved state matters), and saves
the final weights to OUT. --pause-at K: in the middle of step K (after backward, before the
optimizer step) print "paused K" and wait for a signal (a long step being preempted).
--reference REF: afterwards, train a fresh model STEPS steps with no checkpoint, save it to REF.
--device cuda: the model on the GPU (its dropout draws from the CUDA RNG), deterministic kernels.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch
from torch import nn

import memfit

D = 8


class Sampler:
    """A stateful sampler: its position is part of the checkpoint."""

    def __init__(self) -> None:
        self.position = 0

    def next_offset(self) -> float:
        self.position += 1
        return self.position * 0.01

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


DEVICE = "cpu"


def make() -> tuple[nn.Module, torch.optim.Optimizer, object, Sampler]:
    torch.manual_seed(0)  # and every CUDA device's generator
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(D, 16), nn.Dropout(0.3), nn.Tanh(),
                          nn.Linear(16, 1)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, Sampler()


def one_step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, sampler: Sampler,
             pause: bool = False, p: memfit.Preemptible | None = None) -> None:
    x = torch.randn(4, D) * (1 + random.random()) + float(np.random.rand()) + sampler.next_offset()
    x = x.to(DEVICE)
    loss = model(x).pow(2).mean()
    loss.backward()
    if pause:
        assert p is not None
        print(f"paused {p.step + 1}", flush=True)
        deadline = time.monotonic() + 30
        while not p.should_stop() and time.monotonic() < deadline:
            time.sleep(0.01)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--reference")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    global DEVICE
    DEVICE = args.device
    if DEVICE != "cpu":
        torch.use_deterministic_algorithms(True)
    model, opt, sched, sampler = make()
    with memfit.preemptible(args.dir, model=model, optimizer=opt, scheduler=sched,
                            data=sampler, every_steps=2) as p:
        print(f"resumed {p.step}", flush=True)
        for _ in range(p.step, args.steps):
            one_step(model, opt, sched, sampler, pause=p.step + 1 == args.pause_at, p=p)
            p.end_step()
            print(f"step {p.step}", flush=True)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)
    if args.reference:
        model, opt, sched, sampler = make()
        for _ in range(args.steps):
            one_step(model, opt, sched, sampler)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.reference)
    sys.exit(0)


if __name__ == "__main__":
    main()
