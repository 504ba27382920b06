# A stand-in for lmsysorg/sglang:v0.5.23 where that image cannot be pulled or used (no
# registry, no GPU): the CPU image's venv (SGLang 0.5.23, CPU torch, the pinned set)
# without this project, first on PATH as python3 and pip. Building Dockerfile.gpu FROM it
# checks that file's own steps (copy, install, model, entry point), not the SGLang image
# (its Python, CUDA and packages). docker/build-local.sh builds it when GPU_STANDIN=1.
ARG CPU_IMAGE=sglang-vc-cpu:local
FROM ${CPU_IMAGE}
# the CPU venv's start-up shim (sglang_vc.install_startup) stays, run only once the
# project is installed again: it is what lets SGLang import next to CPU torch
RUN .venv/bin/python -m pip uninstall -y -q sglang-vc sgl-kernel-ext \
 && echo "import importlib.util as u; u.find_spec('sglang_vc') and __import__('sglang_vc._startup')" \
    > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sglang_vc_startup.pth" \
 && rm -rf /opt/sglang-vc-home && find /opt/sglang-vc -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
ENV PATH=/opt/sglang-vc/.venv/bin:${PATH}
ENTRYPOINT []
