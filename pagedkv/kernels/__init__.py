"""pagedkv.kernels: the CUDA path of the KV data ops.

- :mod:`~pagedkv.kernels.ops`: launchers with the reference signatures (CUDA tensors);
- :mod:`~pagedkv.kernels.plans`: validation, variant choice and launch arguments;
- :mod:`~pagedkv.kernels.build`: NVRTC compile through the in-process and disk caches;
- :mod:`~pagedkv.kernels.options`: the typed compile options;
- :mod:`~pagedkv.kernels.sources`: the packaged ``.cu`` sources and their entry points;
- :mod:`~pagedkv.kernels.driver`: module load and launch through cuda-python;
- :mod:`~pagedkv.kernels.emulation`: the same kernels built with g++ and run on CPU tensors.

Nothing is imported eagerly: importing this package needs neither torch nor cuda-python.
"""
