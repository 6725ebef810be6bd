# kvgate: one image with both binaries (kvgate-gateway, kvgate-worker), used by the Helm chart (helm/kvgate).
#   docker build -t kvgate:dev .
#   docker build --build-arg FEATURES=cuda --build-arg BUILDER=nvidia/cuda:12.6.3-devel-ubuntu24.04 ...
#     (the CUDA backend of the worker is a later issue; the feature already compiles candle with CUDA)
ARG BUILDER=rust:1.95-bookworm
FROM ${BUILDER} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake pkg-config g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ARG FEATURES=""
RUN cargo build --release --locked -p kvgate-gateway -p kvgate-worker ${FEATURES:+-p kvgate-worker --features kvgate-worker/$FEATURES} \
    && install -m 0755 target/release/kvgate-gateway target/release/kvgate-worker /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/kvgate-gateway /usr/local/bin/kvgate-worker /usr/local/bin/
# Non-root; the chart mounts writable emptyDirs where the binaries write (/tmp, the model cache).
USER 65532:65532
EXPOSE 8080 8081 8000
CMD ["kvgate-gateway", "--help"]
