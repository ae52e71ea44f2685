# One image for every rlbus component; docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent agent
COPY bus bus
COPY runschema runschema
COPY storage storage
COPY weights weights
COPY runtime runtime
COPY rollouter rollouter
COPY trainer trainer
COPY profiler_service profiler_service
COPY profiling profiling
COPY policy policy
COPY tasks tasks
COPY runconfig runconfig
COPY rlbus rlbus
COPY metrics_logger metrics_logger
# Pin torch first so the resolver does not pick a different build for the project.
RUN pip install --no-cache-dir "torch==2.13.0" && pip install --no-cache-dir ".[plot,logger]" "torch==2.13.0"
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["rlbus"]
