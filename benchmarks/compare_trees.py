"""Time tvm-cascade's kernels from several source trees side by side, in one process.

``python -m benchmarks.compare_trees /tmp/old/python python prefill-global-b8-s1024``
compares the ``tvm_cascade`` package under each TREE (e.g. a commit's, from
``mkdir /tmp/old && git archive HEAD~1 python | tar -x -C /tmp/old``, against the
working tree's ``python``) on the named configurations of ``python -m
benchmarks.attention``. Each (tree, configuration) kernel is built by
``kernels.compile_attention`` in a process of its own with that tree first on
``PYTHONPATH`` (``--jobs`` at a time), exported, then loaded into this process, checked
against the float32 reference and timed with ``benchmarks.timing.bench``, the trees in
turn for ``--rounds`` rounds; the minimum per tree is printed. All trees share the C++
core this process loads (``TVM_CASCADE_CORE_LIB``).
"""
import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .attention import close_to, random_inputs, skip_without_gpu
from .configs import suite


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_trees", description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="directories holding a tvm_cascade package")
    parser.add_argument("--only", nargs="+", required=True, metavar="CONFIG", help="configuration names (exact)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel builds")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    configs = {cfg.name: cfg for cfg in suite("all")}
    unknown = [n for n in args.only if n not in configs]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {sorted(configs)}")
    missing = [str(t) for t in args.trees if not (t / "tvm_cascade").is_dir()]
    if missing:
        parser.error(f"no tvm_cascade package in {missing}")
    if skip_without_gpu("benchmarks.compare_trees"):
        return 0
    import tvm

    target = tvm.target.Target.from_device(tvm.cuda(0))
    with tempfile.TemporaryDirectory() as out:
        libraries = _build_all(args.trees, args.only, Path(out), args.jobs, target)
        for name in args.only:
            print(f"{name}: " + "  ".join(_time_trees(configs[name], libraries, name, args.rounds)), flush=True)
    return 0


def _build_all(trees, names, out, jobs, target):
    """{(tree, name): exported library path}, built for ``target``; a failed build is
    reported and left out."""
    def build(job):
        index, tree, name = job
        path = out / f"{index}-{name}.so"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree.resolve()), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        code = "import sys; from benchmarks.compare_trees import export; export(*sys.argv[1:])"
        command = [sys.executable, "-c", code, name, str(path), str(target)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{tree} {name}: build failed\n{proc.stderr[-2000:]}", flush=True)
            return (tree, name), None
        return (tree, name), path

    jobs_list = [(i, tree, name) for i, (name, tree) in enumerate((n, t) for n in names for t in trees)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return {job: path for job, path in pool.map(build, jobs_list) if path is not None}


def export(name, path, target):
    """Build configuration ``name`` for ``target`` with the tvm_cascade first on
    ``sys.path``; export it to ``path``."""
    import tvm
    from tvm_cascade.bench import VARIANTS
    from tvm_cascade.kernels import compile_attention

    cfg = {c.name: c for c in suite("all")}[name]
    o = cfg.op
    compile_attention(
        cfg.batch, o.heads_q, o.heads_kv, cfg.seq_q, cfg.seq_kv, cfg.head_dim,
        variant=VARIANTS[o.variant], dtype=cfg.dtype, target=tvm.target.Target(target),
    ).export_library(path)


def _time_trees(cfg, libraries, name, rounds):
    import torch
    import tvm

    from .reference import attention_reference
    from .timing import bench

    q, k, v = random_inputs(cfg)
    ref = attention_reference(cfg, q, k, v)
    runs = {}
    for (tree, built), path in libraries.items():
        if built != name:
            continue
        kernel = tvm.runtime.load_module(str(path))["main"]

        def run(kernel=kernel):
            out = torch.empty_like(q)
            kernel(*(tvm.runtime.from_dlpack(t) for t in (q, k, v, out)))
            return out

        runs[tree] = (run, close_to(run(), ref))
    times = {tree: [] for tree in runs}
    for _ in range(rounds):
        for tree, (run, _) in runs.items():
            times[tree].append(bench(run))
    return [f"{tree}: {min(ms):.4f} ms{'' if runs[tree][1] else ' WRONG'}" for tree, ms in times.items()]


if __name__ == "__main__":
    sys.exit(main())
