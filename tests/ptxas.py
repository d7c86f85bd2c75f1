"""ptxas's verbose report of generated CUDA assembled for sm_90a, for the tests that check
what ptxas makes of a kernel (spills, ignored ``setmaxnreg``, serialised wgmma).

A test marked :func:`assembled` has its kernel built and assembled in a subprocess that
the session starts ahead of it (``runs_ahead.py``), on the core the pytest process leaves
idle; run as a script, this module is that subprocess."""
import shutil
import subprocess
import sys
from pathlib import Path

from runs_ahead import call_run, called, runs


def ptxas_report(source, path):
    """The report (nvcc's stderr) of CUDA ``source``, written to ``path`` and assembled
    with ``nvcc -cubin -arch=sm_90a -Xptxas -v``."""
    path.write_text(source)
    command = ["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(path.with_suffix(".cubin")), str(path)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed on {path}:\n{proc.stderr}")
    return proc.stderr


def assembled(source_of):
    """Marks a test whose CUDA source is ``source_of(**the test's parameters)`` (a function
    at the top of the test's module, which may also check what it builds): built and
    assembled ahead of the test, which reads both with :func:`assembly`. Without nvcc
    nothing is started (such tests skip or fail on their own)."""

    def make(tmp_path_factory, **params):
        if shutil.which("nvcc") is None:
            return None
        folder = tmp_path_factory.mktemp("ptxas")
        return call_run(folder, __file__, source_of, params, str(folder / "kernel.cu"))

    return runs(make)


def assembly(runs_ahead, request):
    """The CUDA source and ptxas report of the test :func:`assembled` marks."""
    run = runs_ahead.result(request.node)
    assert run.returncode == 0, run.stderr
    return Path(run.args[-1]).read_text(), run.stdout


if __name__ == "__main__":
    source_of, params, (path,) = called(sys.argv[1:])
    sys.stdout.write(ptxas_report(source_of(**params), Path(path)))
