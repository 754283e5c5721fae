# Stand-in for jaegertracing/all-in-one:1.62.0: an OTLP/HTTP receiver on 4318 that
# keeps the spans it is sent and answers /v1/metrics with 404 as Jaeger does, its spans
# as JSON on 16686 (/api/spans), and the admin health port 14269.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 wget \
    && rm -rf /var/lib/apt/lists/*
COPY otlp_standin.py /usr/local/bin/otlp_standin.py
EXPOSE 4317 4318 14269 16686
CMD ["python3", "-u", "/usr/local/bin/otlp_standin.py"]
