// The reference talker stage: llmstage.v1.Stage over the talker's codec (see codec.h).
//
// Slots follow the contract's state machine exactly as the Python LLM stage does: every
// legality check and refusal comes from the one table in slot_machine.h.
// Prepare opens a subscription to the bound thinker's hidden port at once and buffers what
// arrives; a Step stream turns each hidden message into one frame code and streams them, one
// StepEvent per round, under the stream's credit window.
//
// A slot nobody touched (no call named it) for the slot TTL is dropped, in any state but a
// live run (slot_machine.h, MayExpire); an unstarted one ends cancelled first.
//
// Threads: gRPC handler threads, one reader thread per Step stream, one thread per
// subscription, the slot TTL's reaper. Every piece of slot and cohort state is guarded by one
// mutex (`mu_`); nothing blocks while holding it (writes, joins and projections happen outside
// it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "codec.h"
#include "slot_machine.h"
#include "llmstage/hidden_subscriber.h"
#include "llmstage/v1/stage.grpc.pb.h"

namespace talker {

namespace v1 = llmstage::v1;
using Clock = std::chrono::steady_clock;

constexpr int kMaxBatch = 64;
constexpr int kDefaultWindow = 16;
constexpr int kMaxWindow = 1024;
constexpr size_t kMaxPendingRefusals = 1024;
// Largest hidden size served: its projection takes kMaxHidden * 2048 * 4 bytes (128 MiB).
constexpr int64_t kMaxHidden = 16384;
// How long a slot nobody touches lives (--slot-ttl-s), as the Python stage's default.
constexpr double kDefaultSlotTtlS = 600.0;

struct RunEnd {
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  std::string error;
};

struct Cohort;

struct Slot {
  int64_t slot_id = 0;
  std::string request_id;
  // W3C trace context: the traceparent of the call that admitted the slot (gRPC metadata),
  // of the request (AdmitRequest.traceparent), and of the Prepare call, which the talker's own
  // Subscribe to the thinker carries on.
  std::string admit_traceparent;
  std::string request_traceparent;
  std::string prepare_traceparent;
  SlotState state = SlotState::kAdmitted;
  // The subscription (from Prepare on).
  std::string endpoint;
  std::string subscribe_request_id;
  std::shared_ptr<llmstage::HiddenSubscriber> subscriber;
  uint64_t expected_seq = 0;
  int64_t last_seq = -1;
  int64_t hidden_messages = 0;
  int64_t hidden_rows = 0;
  int64_t hidden_bytes = 0;
  int64_t hidden_size = 0;
  int64_t seq_gaps = 0;
  uint32_t states_crc32 = 0;
  std::string subscription_status;  // gRPC status name once the subscription is over
  std::optional<RunEnd> sub_end;    // how the subscription ended the request (not yet delivered)
  // Frames: every code computed; `delivered` of them went out in StepEvents.
  std::vector<int32_t> frames;
  size_t delivered = 0;
  // The run.
  std::optional<v1::FinishReason> stop;  // Cancel / Finish asked a running member to stop
  std::optional<RunEnd> ended;           // the run ended (its terminal update was made)
  bool is_finishing = false;
  std::weak_ptr<Cohort> cohort;
  int64_t rounds = 0;  // StepEvents this member took part in
  Clock::time_point admitted_at, joined_at, first_frame_at, last_frame_at;
  Clock::time_point touched_at;  // Admit, or the last call that named it and was allowed
  google::protobuf::Struct diagnostics;  // built by Finish
};

struct Cohort {
  std::condition_variable cv;
  std::vector<std::shared_ptr<Slot>> members;  // live members, in join order
  std::vector<std::shared_ptr<Slot>> joined;   // every slot that ever joined
  int64_t credits = 0;
  bool is_client_done = false;
  bool is_reader_done = false;       // the control reader returned: no Read is pending
  std::optional<grpc::Status> error;  // set only by the control reader, as it returns
  std::vector<v1::JoinRefusal> refused;
  uint64_t last_step = 0;
};

class TalkerStage final : public v1::Stage::Service {
 public:
  // `slot_ttl_s` (> 0): how long a slot nobody touches lives; its reaper starts here.
  explicit TalkerStage(std::string stage_id, double slot_ttl_s = kDefaultSlotTtlS);
  ~TalkerStage() override;

  // Ends every Step stream (their members are cancelled) and refuses new work.
  void BeginShutdown();
  // Stops the reaper and every subscription and drops every slot. Call after the server has
  // shut down. Idempotent.
  void Close();

  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*,
                        v1::DescribeResponse*) override;
  grpc::Status Admit(grpc::ServerContext*, const v1::AdmitRequest*,
                     v1::AdmitResponse*) override;
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest*,
                       v1::PrepareResponse*) override;
  grpc::Status Step(grpc::ServerContext*,
                    grpc::ServerReaderWriter<v1::StepEvent, v1::StepRequest>*) override;
  grpc::Status Finish(grpc::ServerContext*, const v1::FinishRequest*,
                      v1::FinishResponse*) override;
  grpc::Status Reset(grpc::ServerContext*, const v1::ResetRequest*,
                     v1::ResetResponse*) override;
  grpc::Status Diagnostics(grpc::ServerContext*, const v1::DiagnosticsRequest*,
                           v1::DiagnosticsResponse*) override;
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest*,
                      v1::CancelResponse*) override;
  grpc::Status Subscribe(grpc::ServerContext*, const v1::SubscribeRequest*,
                         grpc::ServerWriter<v1::SubscribeEvent>*) override;

 private:
  using Graveyard = std::vector<std::shared_ptr<llmstage::HiddenSubscriber>>;

  // CheckCall (slot_machine.h) on the slot `slot_id`; when OK, `*out` is the slot (null when
  // there is none: Admit, or a Reset of an unknown slot), now touched. Requires mu_.
  grpc::Status Require(int64_t slot_id, SlotCall call, std::shared_ptr<Slot>* out);
  // Drops the slot: its subscription stopped, and no index (slots_, its Step stream's) keeps
  // it. Requires mu_.
  void Forget(const std::shared_ptr<Slot>& slot, Graveyard* graveyard);
  // The reaper thread: every slot_ttl_s / 4, drops the slots idle for slot_ttl_s.
  void ReapIdle();
  void Enter(const std::shared_ptr<Cohort>& cohort, const std::shared_ptr<Slot>& slot);
  bool BuildEvent(Cohort& cohort, v1::StepEvent* event);
  void CloseCohort(const std::shared_ptr<Cohort>& cohort, bool is_broken, Graveyard* graveyard);
  void ReadControls(grpc::ServerReaderWriter<v1::StepEvent, v1::StepRequest>* stream,
                    const std::shared_ptr<Cohort>& cohort);
  void OnHidden(const std::weak_ptr<Slot>& weak, v1::SubscribeEvent&& event);
  void OnSubscriptionDone(const std::weak_ptr<Slot>& weak, const grpc::Status& status);
  void StopSubscription(Slot& slot, Graveyard* graveyard);
  void Notify(Slot& slot);
  void FinishSlot(Slot& slot, Graveyard* graveyard);
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& endpoint);

  const std::string stage_id_;
  const double slot_ttl_s_;
  ProjectionCache projections_;
  std::mutex mu_;
  std::condition_variable ended_cv_;  // a slot's run ended
  std::map<int64_t, std::shared_ptr<Slot>> slots_;
  std::set<std::shared_ptr<Cohort>> cohorts_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
  uint64_t num_steps_ = 0;
  int64_t num_frames_ = 0;
  int64_t num_hidden_messages_ = 0;
  bool is_shutting_down_ = false;
  bool is_closed_ = false;
  std::condition_variable reaper_cv_;  // Close wakes the reaper
  std::thread reaper_;                 // last: starts once everything above is built
};

std::string ReasonName(v1::FinishReason reason);  // "max_length", ...

}  // namespace talker
