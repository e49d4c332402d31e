"""What a command line does before anything else runs: ``openmp`` chooses the OpenMP runtime torch's CPU kernels
run on, re-executing the process on Intel's when that is installed.

The layer of the command lines and the benchmarks, which import it; the library never does, so code that imports
mmcache keeps the runtime its process was started with. Nothing here imports torch.
"""
