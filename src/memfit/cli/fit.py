"""``memfit fit``: search the fastest training configuration that fits, print or save the plan.

The model is a preset name (`memfit models`), a Hugging Face config.json, or ``module:factory``:
memfit imports ``module`` (from the current directory or the Python path) and calls
``factory()`` with no arguments. The factory returns ``(model, sample_batch)`` (a sample batch as
the model takes it: tensor, tuple -> ``model(*batch)``, dict -> ``model(**batch)``; any batch size)
or a model alone that carries its sample as ``model.sample_batch``. The model's own output must
be (or contain) its loss, or a tensor whose sum is backpropagated (see ``memfit.estimate``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from memfit.cli._common import console, positive_int, print_json
from memfit.cli.layout import parallel_from_args, pp_split_from_arg, tp_plan_from_arg
from memfit.errors import MemfitError
from memfit.gpus import get_gpu
from memfit.units import parse_bytes

EPILOG = """examples:
  memfit fit gpt2 --gpu a100-40gb --global-batch 256 --seq 1024
  memfit fit mypkg.train:make --budget 2GB --device cpu --global-batch 64 --save plan.json
  memfit fit llama-3.1-8b --gpu h100-80gb --gpus 16 --gpus-per-node 8 --global-batch 256
  memfit fit gpt2 --budget 8GB --global-batch 64 --device cpu --rates plan.json
"""


def register(sub: Any) -> None:
    p = sub.add_parser("fit", help="find the fastest configuration that fits a GPU or a budget",
                       description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="preset name, config.json, or module:factory")
    p.add_argument("--gpu", help="GPU from the catalog (`memfit gpus`)")
    p.add_argument("--budget", help="memory budget, e.g. 2GB or 1.5GiB (with --gpu: the smaller)")
    p.add_argument("--global-batch", required=True, help="samples per optimizer step")
    p.add_argument("--seq", help="sequence length for presets/config.json (default: the model's, "
                   "capped at 2048)")
    p.add_argument("--optimizer", default="adamw", help="optimizer (default adamw)")
    p.add_argument("--gpus", default="1", help="number of GPUs: with more than one, the layout is "
                   "searched too (DDP, ZeRO-1/2, FSDP, HSDP x tensor x pipeline parallelism)")
    p.add_argument("--gpus-per-node", help="GPUs per node (default: all on one node); tensor "
                   "parallelism stays inside a node, collectives across nodes run at the "
                   "network's rate")
    p.add_argument("--tp", help="fix the tensor-parallel size (default: searched)")
    p.add_argument("--pp", help="fix the number of pipeline stages (default: searched)")
    p.add_argument("--tp-plan", default=None, metavar="JSON|FILE",
                   help="with --gpus: the tensor-parallel plan every tp > 1 layout splits the "
                   "model with, a JSON object (or a file holding one) of module-name patterns "
                   "to styles (colwise, rowwise, ...: as memfit plan --tp-plan); saved with the "
                   "plan, applied by Plan.apply")
    p.add_argument("--pp-split", default=None, metavar="NAMES",
                   help="with --gpus: where the pipeline layouts split the model, module names "
                   "separated by commas, each the first element of a stage in one ModuleList / "
                   "Sequential (torchtitan's pipeline_parallel_split_points); the stages are "
                   "one more than the names, one a rank (1F1B, GPipe) or two (interleaved "
                   "1F1B over half as many ranks), any module splits, with --tp-plan inside "
                   "each stage; saved with the plan, applied by Plan.apply")
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default=None,
                   help="target device (default: with --gpu, mps for Apple silicon, else "
                        "cuda; cpu without --gpu)")
    p.add_argument("--measure", action="store_true",
                   help="time real steps of the top candidates and pick the fastest measured")
    p.add_argument("--rates", metavar="FILE",
                   help="pin the rates step times are costed at: a JSON object (flops, "
                   "bandwidth, host_link, gpu_link, inter_node_link, launch_s, sac_op_s; FLOP/s, "
                   "bytes/s, "
                   "seconds) or a plan saved with --save (default: the GPU catalog's; on cpu "
                   "this machine's, measured once and kept in ~/.cache/memfit)")
    p.add_argument("--flops", help="pin the matmul rate in FLOP/s, e.g. 113e9 or 113G for every "
                   "precision, or fp32=113G,bf16-mixed=40G (over --rates)")
    p.add_argument("--mem-bandwidth", help="pin the memory bandwidth in bytes/s, e.g. 20GB/s "
                   "(over --rates)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
    p.add_argument("--save", help="write the plan to this JSON file (memfit.Plan.load reads it)")
    p.set_defaults(func=run)


def _load_factory(target: str) -> tuple[Any, Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise MemfitError(f"{target!r}: write module:factory, e.g. mypkg.train:make_model")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise MemfitError(f"cannot import module {module_name!r} ({exc}); run from the folder "
                          "holding it or install it") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise MemfitError(f"{module_name} has no callable {attr!r}; define def {attr}(): return "
                          "model, sample_batch")
    made = factory()
    import torch

    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        return made[0], made[1]
    if isinstance(made, torch.nn.Module):
        sample = getattr(made, "sample_batch", None)
        if sample is None:
            raise MemfitError(f"{target} returned a model alone; return (model, sample_batch) or "
                              "set model.sample_batch")
        return made, sample
    raise MemfitError(f"{target} returned {type(made).__name__}; return (model, sample_batch) "
                      "or a model with a sample_batch attribute")


def _load_preset(name: str, seq: int | None) -> tuple[Any, Any]:
    from memfit.models import resolve_model
    from memfit.models.build import build_model, example_inputs

    spec = resolve_model(name)
    if seq is not None:
        from memfit.analytic.checks import check_context
        from memfit.analytic.config import RunConfig

        if spec.arch == "vision":
            raise MemfitError(f"{spec.name} sees {spec.default_seq_len} tokens per image; drop "
                              "--seq for vision models")
        check_context(spec, RunConfig(seq=seq))
    model = build_model(spec, device="meta")
    if spec.arch != "vision" and seq is None:
        seq = min(spec.default_seq_len, 2048)
    return model, example_inputs(spec, batch=1, seq=None if spec.arch == "vision" else seq)


def _pinned_rates(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--rates FILE``, then ``--flops`` and ``--mem-bandwidth`` over it; None: none pinned."""
    from memfit.fitting.rates import load_rates, merge_pins, parse_pin

    pins = load_rates(args.rates) if args.rates else {}
    named = [f"--rates {args.rates}"] if args.rates else []
    for key, flag, value in (("flops", "--flops", args.flops),
                             ("bandwidth", "--mem-bandwidth", args.mem_bandwidth)):
        if value is not None:
            pins = merge_pins(pins, {key: parse_pin(key, value, flag)})
            named.append(flag)
    if not named:
        return None
    pins["source"] = ", ".join(named)
    return pins


def _pp_split(value: str | None, pp: int | None, num_gpus: int | None
              ) -> tuple[str, ...] | None:
    """``--pp-split``: the split points of every pipeline layout searched, ``pp`` (``--pp``,
    else searched) one more than the names, or half one more (interleaved 1F1B, two stages a
    rank); one line without ``--gpus N``."""
    if value is None:
        return None
    if not num_gpus or num_gpus == 1:
        raise MemfitError(f"--pp-split {value} splits the model into pipeline stages over "
                          "several GPUs; add --gpus N (N > 1)")
    stages = len(value.split(",")) + 1
    schedule = "interleaved-1f1b" if pp is not None and pp > 1 and stages == 2 * pp else None
    return pp_split_from_arg(value, pp or stages, schedule)


def run(args: argparse.Namespace) -> int:
    from memfit.fitting import fit

    global_batch = positive_int(args.global_batch, "--global-batch")
    num_gpus = positive_int(args.gpus, "--gpus")
    space = {name: [value] for name in ("tp", "pp")
             if (value := positive_int(getattr(args, name), f"--{name}")) is not None}
    seq = positive_int(args.seq, "--seq")
    pp_split = _pp_split(args.pp_split, space.get("pp", [None])[0], num_gpus)
    budget = parse_bytes(args.budget, what="--budget") if args.budget else None
    if args.gpu is None and budget is None:
        raise MemfitError("give --gpu NAME (see `memfit gpus`) or --budget SIZE (e.g. 2GB)")
    device = args.device or ("cpu" if not args.gpu else
                             "mps" if get_gpu(args.gpu).target == "mps" else "cuda")
    pins = _pinned_rates(args)
    if ":" in args.model and not Path(args.model).exists():
        if seq is not None:
            raise MemfitError(f"--seq {seq} applies to presets and config.json; the sample "
                              f"batch of {args.model} sets the sequence length: drop --seq")
        model, sample = _load_factory(args.model)
    else:
        model, sample = _load_preset(args.model, seq)
    if args.measure:
        if any(p.device.type == "meta" for p in model.parameters()):
            raise MemfitError("--measure runs real steps and needs a real model: use "
                              "module:factory returning a model with weights")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise MemfitError("--measure on cuda needs a GPU; drop --measure or use "
                                  "--device cpu")
    if global_batch is None or num_gpus is None:  # argparse requires/defaults them
        raise MemfitError("--global-batch and --gpus must be positive integers")
    if num_gpus == 1 and (args.gpus_per_node is not None or space):
        raise MemfitError("--gpus-per-node, --tp and --pp lay out several GPUs; add --gpus N")
    # The layout flags as plan reads them (cli/layout.py); --tp / --pp fix the searched degrees.
    # --tp-plan goes to the search, which puts it on its tp > 1 layouts (--tp may be searched)
    layout = parallel_from_args(argparse.Namespace(**{**vars(args), "tp_plan": None,
                                                      "pp_split": None}))
    tp_plan = tp_plan_from_arg(args.tp_plan)
    if tp_plan is not None and num_gpus == 1:
        raise MemfitError("--tp-plan splits the model over tensor-parallel ranks; add --gpus N "
                          "(N > 1)")
    plan = fit(model, sample, optimizer=args.optimizer, global_batch=global_batch,
               gpu=args.gpu, budget_bytes=budget, device=device,
               gpus=num_gpus if num_gpus > 1 else None, gpus_per_node=layout.gpus_per_node,
               space=space or None, measure=args.measure, progress=False if args.quiet
               or args.json else None, rates=pins, tp_plan=tp_plan,
               pp_split_points=pp_split)
    if args.save:
        plan.save(args.save)
    if args.json:
        print_json(plan.to_dict())
    else:
        sys.stdout.write(plan.render(width=console().width))
        if args.save:
            print(f"saved to {args.save}")
    return 0
