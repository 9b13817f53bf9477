"""``python -m worker.cpu_kernels``: build the CPU kernels ahead of the first worker (``make install`` runs it)."""

from worker.cpu_kernels import build_directory, load

if __name__ == "__main__":
    print(f"cpu kernels {'built' if load() is not None else 'not available'} in {build_directory()}")
