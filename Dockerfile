# kvgate: one image with both binaries (kvgate-gateway, kvgate-worker), used by the Helm chart (helm/kvgate).
#   docker build -t kvgate:dev .                      # CPU image (debian-slim)
#   docker build --target gpu -t kvgate:dev-gpu .     # the same binaries on a CUDA 13.0 runtime base image
# The worker needs nothing CUDA at build time: it loads libcuda (from the NVIDIA driver, mounted by the device
# plugin), libnvrtc and libcublas (from the CUDA runtime image) at run time, and serves on the CPU without them.
ARG BUILDER=rust:1.95-bookworm
FROM ${BUILDER} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake pkg-config g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-gateway -p kvgate-worker \
    && install -m 0755 -s target/release/kvgate-gateway target/release/kvgate-worker /usr/local/bin/

# GPU workers: libcublas and libnvrtc of CUDA 13.0 (newer NVRTC emits code a CUDA 13.0 driver rejects).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS gpu
COPY --from=build /usr/local/bin/kvgate-gateway /usr/local/bin/kvgate-worker /usr/local/bin/
ENV KVGATE_CACHE_DIR=/var/cache/kvgate
USER 65532:65532
EXPOSE 8080 8081 8000
CMD ["kvgate-worker", "--help"]

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/kvgate-gateway /usr/local/bin/kvgate-worker /usr/local/bin/
# Non-root; the chart mounts writable emptyDirs where the binaries write (/tmp, the model cache).
USER 65532:65532
EXPOSE 8080 8081 8000
CMD ["kvgate-gateway", "--help"]
