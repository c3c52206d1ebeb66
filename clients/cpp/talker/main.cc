// talker_stage: the reference talker stage service (see README.md).
//
//   talker_stage [--host 127.0.0.1] [--port 0] [--stage-id talker] [--slot-ttl-s 600]
//   talker_stage --version
//
// Prints "talker: listening on HOST:PORT" (the real port) as its first stdout line, serves
// llmstage.v1.Stage plus the gRPC health and reflection services, and exits 0 after a graceful
// shutdown on SIGTERM or SIGINT.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "talker_service.h"

// The project's version, from CMakeLists.txt's project().
#ifndef LLMSTAGE_VERSION
#error "LLMSTAGE_VERSION is defined by CMakeLists.txt"
#endif

namespace {

constexpr char kUsage[] =
    "usage: talker_stage [--host 127.0.0.1] [--port 0] [--stage-id talker] [--slot-ttl-s 600]\n"
    "       talker_stage --version\n"
    "  A reference talker stage (llmstage.v1.Stage): for wiring and tests, not a speech model.\n"
    "  --port 0 picks a free port; the first stdout line says which.\n"
    "  --slot-ttl-s S: drop slots nobody touched for S seconds (default 600), in any state\n"
    "  but a run still running; an unstarted one ends cancelled.\n";

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string stage_id = "talker";
  double slot_ttl_s = talker::kDefaultSlotTtlS;
};

[[noreturn]] void UsageError(const std::string& message) {
  std::cerr << "talker_stage: " << message << "\n" << kUsage;
  std::exit(2);
}

Options ParseArgs(int argc, char** argv) {
  Options opts;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (arg == "--version") {
      std::cout << "talker_stage " << LLMSTAGE_VERSION << " (contract llmstage.v1)\n";
      std::exit(0);
    }
    std::string value;
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (arg == "--host" || arg == "--port" || arg == "--stage-id" ||
               arg == "--slot-ttl-s") {
      if (i + 1 >= argc) UsageError(arg + " needs a value");
      value = argv[++i];
    } else {
      UsageError("unknown argument " + arg);
    }
    if (arg == "--host") {
      if (value.empty()) UsageError("--host is empty");
      opts.host = value;
    } else if (arg == "--port") {
      char* end = nullptr;
      const long port = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || port < 0 || port > 65535) {
        UsageError("--port must be a number in [0, 65535], got " + value);
      }
      opts.port = static_cast<int>(port);
    } else if (arg == "--stage-id") {
      if (value.empty()) UsageError("--stage-id is empty");
      opts.stage_id = value;
    } else if (arg == "--slot-ttl-s") {
      char* end = nullptr;
      const double ttl = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(ttl) || ttl <= 0) {
        UsageError("--slot-ttl-s must be a positive number of seconds, got " + value);
      }
      opts.slot_ttl_s = ttl;
    } else {
      UsageError("unknown argument " + arg);
    }
  }
  return opts;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opts = ParseArgs(argc, argv);

  // SIGTERM and SIGINT are taken by sigwait below; block them before any thread starts so
  // every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  talker::TalkerStage stage(opts.stage_id, opts.slot_ttl_s);
  const bool is_ipv6 = opts.host.find(':') != std::string::npos && opts.host.front() != '[';
  const std::string host = is_ipv6 ? "[" + opts.host + "]" : opts.host;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(host + ":" + std::to_string(opts.port),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&stage);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "talker_stage: cannot listen on " << host << ":" << opts.port << "\n";
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus("llmstage.v1.Stage", true);
  std::printf("talker: listening on %s:%d\n", host.c_str(), port);
  std::fflush(stdout);

  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  std::fprintf(stderr, "talker: %s, shutting down\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server->GetHealthCheckService()->SetServingStatus(false);
  stage.BeginShutdown();  // Step streams end (their members are cancelled)
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  stage.Close();
  return 0;
}
