# The reference C++ talker stage, built against Debian's gRPC and protobuf.
FROM debian:bookworm-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        g++ cmake make pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev \
        protobuf-compiler && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY protos ./protos
COPY clients/cpp ./clients/cpp
RUN cmake -S clients/cpp -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j"$(nproc)"

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgrpc++1.51 \
        libprotobuf32 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/talker_stage /usr/local/bin/talker_stage
EXPOSE 50052
CMD ["talker_stage", "--host", "0.0.0.0", "--port", "50052"]
