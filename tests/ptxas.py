"""ptxas's verbose report of generated CUDA assembled for sm_90a, for the tests that check
what ptxas makes of a kernel (spills, ignored ``setmaxnreg``, serialised wgmma)."""
import subprocess


def ptxas_report(source, path):
    """The report (nvcc's stderr) of CUDA ``source``, written to ``path`` and assembled
    with ``nvcc -cubin -arch=sm_90a -Xptxas -v``."""
    path.write_text(source)
    command = ["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(path.with_suffix(".cubin")), str(path)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stderr
