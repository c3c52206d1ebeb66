#include "talker_service.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <utility>

#include "llmstage/tensor.h"

namespace talker {
namespace {

using grpc::Status;
using grpc::StatusCode;

Status InvalidArgument(const std::string& message) {
  return Status(StatusCode::INVALID_ARGUMENT, message);
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char* CodeName(StatusCode code) {
  switch (code) {
    case StatusCode::OK: return "OK";
    case StatusCode::CANCELLED: return "CANCELLED";
    case StatusCode::UNKNOWN: return "UNKNOWN";
    case StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case StatusCode::NOT_FOUND: return "NOT_FOUND";
    case StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case StatusCode::ABORTED: return "ABORTED";
    case StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case StatusCode::INTERNAL: return "INTERNAL";
    case StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case StatusCode::DATA_LOSS: return "DATA_LOSS";
    case StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

void Put(google::protobuf::Struct* s, const std::string& key, double value) {
  (*s->mutable_fields())[key].set_number_value(value);
}

void Put(google::protobuf::Struct* s, const std::string& key, const std::string& value) {
  (*s->mutable_fields())[key].set_string_value(value);
}

void PutNull(google::protobuf::Struct* s, const std::string& key) {
  (*s->mutable_fields())[key].set_null_value(google::protobuf::NULL_VALUE);
}

// Well-formedness of a request (llm_runner_svc/stage/request.py), without tokenizing it.
Status CheckRequest(const v1::GenerationRequest& req) {
  using R = v1::GenerationRequest;
  switch (req.prompt_case()) {
    case R::PROMPT_NOT_SET:
      return InvalidArgument("a request needs exactly one prompt: text, messages or token_ids "
                             "(got 0)");
    case R::kText:
      if (req.text().empty()) return InvalidArgument("prompt text is empty");
      break;
    case R::kMessages:
      if (req.messages().messages().empty()) {
        return InvalidArgument("messages is empty: at least one message is required");
      }
      break;
    case R::kTokenIds:
      if (req.token_ids().ids().empty()) {
        return InvalidArgument("token_ids is empty: at least one token is required");
      }
      for (int32_t id : req.token_ids().ids()) {
        if (id < 0) return InvalidArgument("token_ids holds a negative id");
      }
      break;
  }
  const auto& s = req.sampling();
  if (s.has_temperature() && !std::isfinite(s.temperature())) {
    return InvalidArgument("sampling.temperature must be a finite number");
  }
  if (s.has_top_p() && !std::isfinite(s.top_p())) {
    return InvalidArgument("sampling.top_p must be a finite number");
  }
  for (const auto& stop : req.stop()) {
    if (stop.empty()) return InvalidArgument("stop strings must not be empty");
  }
  for (const auto& port : req.ports()) {
    if (port.empty()) return InvalidArgument("ports holds an empty name");
  }
  return Status::OK;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(),
                                                suffix) == 0;
}

v1::SlotState ToProto(SlotState state) {
  switch (state) {
    case SlotState::kAdmitted: return v1::SLOT_STATE_ADMITTED;
    case SlotState::kPrepared: return v1::SLOT_STATE_PREPARED;
    case SlotState::kRunning: return v1::SLOT_STATE_RUNNING;
    case SlotState::kFinished: return v1::SLOT_STATE_FINISHED;
  }
  return v1::SLOT_STATE_UNSPECIFIED;
}

}  // namespace

std::string ReasonName(v1::FinishReason reason) {
  std::string name = v1::FinishReason_Name(reason);
  const std::string prefix = "FINISH_REASON_";
  if (name.compare(0, prefix.size(), prefix) == 0) name = name.substr(prefix.size());
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

namespace {

// What the slot table needs to know of a slot.
SlotView ViewOf(const Slot& slot) {
  SlotView view;
  view.state = slot.state;
  view.is_ended = slot.ended.has_value();
  if (slot.ended) view.ended_reason = ReasonName(slot.ended->reason);
  view.is_finishing = slot.is_finishing;
  return view;
}

}  // namespace

TalkerStage::TalkerStage(std::string stage_id, double slot_ttl_s)
    : stage_id_(std::move(stage_id)), slot_ttl_s_(slot_ttl_s) {
  reaper_ = std::thread([this] { ReapIdle(); });
}

TalkerStage::~TalkerStage() { Close(); }

void TalkerStage::BeginShutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  is_shutting_down_ = true;
  for (const auto& cohort : cohorts_) cohort->cv.notify_all();
  ended_cv_.notify_all();
}

void TalkerStage::Close() {
  Graveyard graveyard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    is_shutting_down_ = true;
    is_closed_ = true;
    reaper_cv_.notify_all();
    for (auto& [id, slot] : slots_) StopSubscription(*slot, &graveyard);
    slots_.clear();
    cohorts_.clear();
    ended_cv_.notify_all();
  }
  if (reaper_.joinable()) reaper_.join();
  graveyard.clear();  // joins the subscription threads, outside the lock
}

// The kit's _reap_idle: a slot nobody touched for slot_ttl_s (a caller that vanished between
// calls, or one that never finishes the ended members of a stream it broke) is dropped, in any
// state but a live run; an unstarted one ends cancelled first.
void TalkerStage::ReapIdle() {
  const std::chrono::duration<double> period(std::clamp(slot_ttl_s_ / 4, 0.05, 3600.0));
  std::unique_lock<std::mutex> lock(mu_);
  while (!is_closed_) {
    reaper_cv_.wait_for(lock, period);
    if (is_closed_) break;
    const Clock::time_point now = Clock::now();
    std::vector<std::shared_ptr<Slot>> idle;
    for (const auto& [id, slot] : slots_) {
      if (Seconds(now - slot->touched_at) > slot_ttl_s_ && MayExpire(SubStateOf(ViewOf(*slot)))) {
        idle.push_back(slot);
      }
    }
    if (idle.empty()) continue;
    Graveyard graveyard;
    for (const auto& slot : idle) {
      const SubState sub = SubStateOf(ViewOf(*slot));
      std::fprintf(stderr, "talker: slot %lld idle for %g s in %s; dropped\n",
                   static_cast<long long>(slot->slot_id), slot_ttl_s_, SubStateName(sub));
      if (sub == SubState::kAdmitted || sub == SubState::kPrepared) {
        slot->ended = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
      }
      Forget(slot, &graveyard);
    }
    ended_cv_.notify_all();
    lock.unlock();
    graveyard.clear();  // joins the subscription threads, outside the lock
    lock.lock();
  }
}

// ---- helpers (mu_ held) -------------------------------------------------------------------------

Status TalkerStage::Require(int64_t slot_id, SlotCall call, std::shared_ptr<Slot>* out) {
  auto it = slots_.find(slot_id);
  if (it == slots_.end()) return CheckCall(call, slot_id, nullptr);
  const SlotView view = ViewOf(*it->second);
  Status st = CheckCall(call, slot_id, &view);
  if (st.ok()) {
    it->second->touched_at = Clock::now();
    *out = it->second;
  }
  return st;
}

void TalkerStage::Forget(const std::shared_ptr<Slot>& slot, Graveyard* graveyard) {
  StopSubscription(*slot, graveyard);
  auto it = slots_.find(slot->slot_id);
  if (it != slots_.end() && it->second == slot) slots_.erase(it);
  // A Step stream lives for many requests: it must not keep the slots it served.
  if (auto cohort = slot->cohort.lock()) {
    auto& joined = cohort->joined;
    joined.erase(std::remove(joined.begin(), joined.end(), slot), joined.end());
  }
}

void TalkerStage::StopSubscription(Slot& slot, Graveyard* graveyard) {
  if (slot.subscriber) {
    slot.subscriber->Cancel();
    graveyard->push_back(std::move(slot.subscriber));
    slot.subscriber.reset();
  }
}

void TalkerStage::Notify(Slot& slot) {
  if (auto cohort = slot.cohort.lock()) cohort->cv.notify_all();
}

void TalkerStage::Enter(const std::shared_ptr<Cohort>& cohort, const std::shared_ptr<Slot>& slot) {
  slot->state = SlotState::kRunning;
  slot->cohort = cohort;
  slot->joined_at = Clock::now();
  cohort->members.push_back(slot);
  cohort->joined.push_back(slot);
}

std::shared_ptr<grpc::Channel> TalkerStage::ChannelTo(const std::string& endpoint) {
  auto& channel = channels_[endpoint];
  if (!channel) channel = llmstage::MakeChannel(endpoint);
  return channel;
}

// Builds the slot's Diagnostics and marks it FINISHED.
void TalkerStage::FinishSlot(Slot& slot, Graveyard* graveyard) {
  slot.state = SlotState::kFinished;
  StopSubscription(slot, graveyard);
  google::protobuf::Struct* d = &slot.diagnostics;
  d->Clear();
  Put(d, "stage_id", stage_id_);
  Put(d, "request_id", slot.request_id);
  if (slot.ended) {
    Put(d, "finish_reason", ReasonName(slot.ended->reason));
    if (!slot.ended->error.empty()) Put(d, "error", slot.ended->error);
  } else {
    PutNull(d, "finish_reason");
  }
  Put(d, "frames", static_cast<double>(slot.frames.size()));
  Put(d, "frames_streamed", static_cast<double>(slot.delivered));
  Put(d, "hidden_messages", static_cast<double>(slot.hidden_messages));
  Put(d, "hidden_rows", static_cast<double>(slot.hidden_rows));
  Put(d, "hidden_bytes", static_cast<double>(slot.hidden_bytes));
  Put(d, "hidden_size", static_cast<double>(slot.hidden_size));
  if (slot.last_seq >= 0) {
    Put(d, "last_seq", static_cast<double>(slot.last_seq));
  } else {
    PutNull(d, "last_seq");
  }
  Put(d, "seq_gaps", static_cast<double>(slot.seq_gaps));
  Put(d, "states_crc32", static_cast<double>(slot.states_crc32));
  Put(d, "subscribe_endpoint", slot.endpoint);
  Put(d, "traceparent", slot.admit_traceparent);
  Put(d, "request_traceparent", slot.request_traceparent);
  Put(d, "prepare_traceparent", slot.prepare_traceparent);
  Put(d, "subscribe_request_id", slot.subscribe_request_id);
  Put(d, "subscription_status", slot.subscription_status);
  Put(d, "steps", static_cast<double>(slot.rounds));
  Put(d, "codes", static_cast<double>(kNumCodes));
}

// ---- the contract -------------------------------------------------------------------------------

Status TalkerStage::Describe(grpc::ServerContext*, const v1::DescribeRequest*,
                             v1::DescribeResponse* out) {
  out->set_contract_version("llmstage.v1");
  out->set_stage_id(stage_id_);
  out->set_runner("talker.codec");
  v1::PortSpec* port = out->add_emits();
  port->set_name("audio");
  port->set_dtype(v1::DTYPE_INT32);
  port->set_width(1);
  out->add_inputs("hidden");
  out->set_max_batch(kMaxBatch);
  out->set_max_step_window(kMaxWindow);
  out->set_engine("cpp");
  v1::ModelInfo* model = out->mutable_model();
  model->set_name("codec-projection-2048");
  model->set_format("builtin");
  model->set_architecture("projection");
  model->set_vocab_size(kNumCodes);
  return Status::OK;
}

// The traceparent a call carried in its metadata ("" when none).
static std::string TraceparentOf(const grpc::ServerContext* context) {
  const auto& md = context->client_metadata();
  auto it = md.find("traceparent");
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

Status TalkerStage::Admit(grpc::ServerContext* context, const v1::AdmitRequest* req,
                          v1::AdmitResponse* out) {
  Status st = CheckSlotId(req->slot_id());
  if (!st.ok()) return st;
  if (!req->has_request()) return InvalidArgument("AdmitRequest.request is required");
  st = CheckRequest(req->request());
  if (!st.ok()) return st;
  std::lock_guard<std::mutex> lock(mu_);
  if (is_shutting_down_) {
    return Status(StatusCode::UNAVAILABLE, "the stage is shutting down; send new requests "
                                           "elsewhere");
  }
  std::shared_ptr<Slot> existing;
  st = Require(req->slot_id(), SlotCall::kAdmit, &existing);
  if (!st.ok()) return st;
  auto slot = std::make_shared<Slot>();
  slot->slot_id = req->slot_id();
  slot->request_id = req->request().request_id().empty()
                         ? "slot-" + std::to_string(req->slot_id())
                         : req->request().request_id();
  slot->admitted_at = Clock::now();
  slot->touched_at = slot->admitted_at;
  slot->admit_traceparent = TraceparentOf(context);
  slot->request_traceparent = req->traceparent();
  slots_[slot->slot_id] = slot;
  out->set_admitted(true);
  out->set_prompt_tokens(0);
  return Status::OK;
}

Status TalkerStage::Prepare(grpc::ServerContext* context, const v1::PrepareRequest* req,
                            v1::PrepareResponse*) {
  std::shared_ptr<llmstage::HiddenSubscriber> subscriber;
  std::string subscribe_endpoint;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Slot> slot;
    Status st = Require(req->slot_id(), SlotCall::kPrepare, &slot);
    if (!st.ok()) return st;
    const v1::InputBinding* binding = nullptr;
    for (const auto& b : req->inputs()) {
      if (!EndsWith(b.input(), ":hidden")) continue;
      if (binding != nullptr) {
        return InvalidArgument("the talker reads one hidden-state input; got " +
                               binding->input() + " and " + b.input());
      }
      binding = &b;
    }
    if (binding == nullptr) return InvalidArgument("the talker needs a hidden-state input binding");
    if (binding->endpoint().empty()) {
      return InvalidArgument("input binding " + binding->input() + " has no endpoint");
    }
    if (binding->request_id().empty()) {
      return InvalidArgument("input binding " + binding->input() + " has no request_id");
    }
    std::weak_ptr<Slot> weak = slot;
    subscriber = std::make_shared<llmstage::HiddenSubscriber>(
        ChannelTo(binding->endpoint()), binding->request_id(),
        [this, weak](v1::SubscribeEvent&& ev) { OnHidden(weak, std::move(ev)); },
        [this, weak](const Status& status) { OnSubscriptionDone(weak, status); });
    slot->endpoint = binding->endpoint();
    subscribe_endpoint = binding->endpoint();
    slot->prepare_traceparent = TraceparentOf(context);
    // The Subscribe joins the request's trace under the call that asked for it.
    const std::string& parent = !slot->prepare_traceparent.empty()
                                    ? slot->prepare_traceparent
                                    : slot->request_traceparent;
    if (!parent.empty()) subscriber->AddMetadata("traceparent", parent);
    slot->subscribe_request_id = binding->request_id();
    slot->subscriber = subscriber;
    slot->state = SlotState::kPrepared;
  }
  // Subscribed before Prepare returns, so nothing of the thinker's prefill is missed: the
  // thinker starts decoding only once every stage of the route is prepared, and it
  // acknowledges a subscription only after registering it.
  subscriber->Start();
  if (subscriber->WaitSubscribed(std::chrono::seconds(10))) return Status::OK;
  subscriber->Cancel();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(req->slot_id());
  if (it != slots_.end() && it->second->subscriber == subscriber) {
    it->second->subscriber.reset();
    it->second->state = SlotState::kAdmitted;
  }
  return Status(StatusCode::UNAVAILABLE,
                "the hidden-state subscription to " + subscribe_endpoint +
                    " was not acknowledged");
}

// ---- the subscription ---------------------------------------------------------------------------

void TalkerStage::OnHidden(const std::weak_ptr<Slot>& weak, v1::SubscribeEvent&& event) {
  auto slot = weak.lock();
  if (!slot) return;
  // The projection runs outside the lock.
  int32_t code = -1;
  int64_t hidden = 0;
  std::string bad;
  if (event.has_hidden()) {
    const v1::Tensor& states = event.hidden().states();
    try {
      if (states.shape_size() != 2) {
        throw std::invalid_argument("states has rank " + std::to_string(states.shape_size()) +
                                    "; [positions, hidden] expected");
      }
      hidden = states.shape(1);
      if (hidden <= 0) throw std::invalid_argument("states has hidden size 0");
      if (hidden > kMaxHidden) {
        throw std::invalid_argument("hidden size " + std::to_string(hidden) +
                                    " exceeds the talker's limit " + std::to_string(kMaxHidden));
      }
      std::vector<float> row = llmstage::DecodeLastRow(states);
      code = CodecFrame(row, *projections_.Get(hidden));
    } catch (const std::exception& e) {
      bad = e.what();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (slot->sub_end || slot->stop || slot->ended || slot->state == SlotState::kFinished) return;
  auto fail = [&](const std::string& error) {
    slot->sub_end = RunEnd{v1::FINISH_REASON_ERROR, error};
    if (slot->subscriber) slot->subscriber->Cancel();
    Notify(*slot);
  };
  if (event.seq() != slot->expected_seq) {
    slot->seq_gaps += 1;
    fail("hidden-state sequence gap: expected " + std::to_string(slot->expected_seq) + ", got " +
         std::to_string(event.seq()));
    return;
  }
  slot->expected_seq += 1;
  slot->last_seq = static_cast<int64_t>(event.seq());
  if (!event.request_id().empty() && event.request_id() != slot->subscribe_request_id) {
    fail("hidden-state message for request " + event.request_id() + " on the subscription to " +
         slot->subscribe_request_id);
    return;
  }
  if (event.has_hidden()) {
    if (!bad.empty()) {
      fail("bad hidden states (seq " + std::to_string(event.seq()) + "): " + bad);
      return;
    }
    const auto& h = event.hidden();
    slot->hidden_messages += 1;
    slot->hidden_rows += h.states().shape(0);
    slot->hidden_bytes += static_cast<int64_t>(h.states().data().size() +
                                               h.embeddings().data().size());
    slot->hidden_size = hidden;
    slot->states_crc32 = Crc32(h.states().data().data(), h.states().data().size(),
                               slot->states_crc32);
    const auto now = Clock::now();
    if (slot->frames.empty()) slot->first_frame_at = now;
    slot->last_frame_at = now;
    slot->frames.push_back(code);
    num_hidden_messages_ += 1;
    num_frames_ += 1;
    Notify(*slot);
  } else if (event.has_end()) {
    RunEnd end{event.end().finish_reason(), event.end().error()};
    if (end.reason == v1::FINISH_REASON_UNSPECIFIED) {
      end = RunEnd{v1::FINISH_REASON_ERROR,
                   "the hidden-state stream ended without a finish reason"};
    }
    slot->sub_end = end;
    Notify(*slot);
  } else {
    fail("unexpected message on the hidden-state subscription (payload case " +
         std::to_string(static_cast<int>(event.payload_case())) + ")");
  }
}

void TalkerStage::OnSubscriptionDone(const std::weak_ptr<Slot>& weak, const Status& status) {
  auto slot = weak.lock();
  if (!slot) return;
  std::lock_guard<std::mutex> lock(mu_);
  slot->subscription_status = CodeName(status.error_code());
  if (slot->sub_end || slot->stop || slot->ended || slot->state == SlotState::kFinished) return;
  std::string why = status.ok()
      ? "the hidden-state stream from " + slot->endpoint + " ended before the request's end"
      : "the hidden-state subscription to " + slot->endpoint + " failed: " +
            CodeName(status.error_code()) + ": " + status.error_message();
  slot->sub_end = RunEnd{v1::FINISH_REASON_ERROR, why};
  Notify(*slot);
}

// ---- Step ---------------------------------------------------------------------------------------

// One round: an update for every member that changed. RUNNING updates need a credit; an event
// of only terminal updates may go out without one (at most one per member). Applies what it
// puts in the event (frames delivered, runs ended) and spends the credit.
bool TalkerStage::BuildEvent(Cohort& cohort, v1::StepEvent* event) {
  std::vector<std::shared_ptr<Slot>> still;
  for (const auto& slot : cohort.members) {
    std::optional<RunEnd> end;
    if (slot->stop) {
      end = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
    } else if (slot->sub_end) {
      end = slot->sub_end;
    }
    const bool has_new = slot->delivered < slot->frames.size();
    if (!end && !(has_new && cohort.credits > 0)) {
      still.push_back(slot);
      continue;
    }
    v1::MemberUpdate* m = event->add_members();
    m->set_slot_id(slot->slot_id);
    for (size_t i = slot->delivered; i < slot->frames.size(); ++i) m->add_token_ids(slot->frames[i]);
    slot->delivered = slot->frames.size();
    slot->rounds += 1;
    if (end) {
      m->set_status(v1::MEMBER_STATUS_ENDED);
      m->set_finish_reason(end->reason);
      m->set_error(end->error);
      slot->ended = end;
      if (slot->subscriber) slot->subscriber->Cancel();
    } else {
      m->set_status(v1::MEMBER_STATUS_RUNNING);
      still.push_back(slot);
    }
  }
  const bool has_members = event->members_size() > 0;
  if (!has_members && (cohort.refused.empty() || cohort.credits == 0)) return false;
  if (has_members) {
    cohort.members = std::move(still);
    num_steps_ += 1;
    cohort.last_step = num_steps_;
    ended_cv_.notify_all();
  }
  event->set_step(cohort.last_step);
  for (auto& r : cohort.refused) *event->add_refused() = std::move(r);
  cohort.refused.clear();
  cohort.credits = std::max<int64_t>(0, cohort.credits - 1);
  return true;
}

void TalkerStage::ReadControls(grpc::ServerReaderWriter<v1::StepEvent, v1::StepRequest>* stream,
                               const std::shared_ptr<Cohort>& cohort) {
  v1::StepRequest msg;
  while (stream->Read(&msg)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cohort->error) return;
    auto fail = [&](Status status) {
      cohort->error = std::move(status);
      cohort->is_reader_done = true;
      cohort->cv.notify_all();
    };
    if (std::any_of(msg.join().begin(), msg.join().end(), [](int64_t s) { return s < 0; })) {
      return fail(InvalidArgument("join holds a negative slot id"));
    }
    if (msg.credits() > 0) {
      const int64_t window = cohort->credits + msg.credits();
      if (window > kMaxWindow) {
        return fail(Status(StatusCode::RESOURCE_EXHAUSTED,
                           "credit window would reach " + std::to_string(window) +
                               "; the most a Step stream may hold is " +
                               std::to_string(kMaxWindow)));
      }
      cohort->credits = window;
    }
    for (int64_t sid : msg.join()) {
      std::shared_ptr<Slot> slot;
      Status st = Require(sid, SlotCall::kStep, &slot);
      if (st.ok()) {
        Enter(cohort, slot);
        continue;
      }
      v1::JoinRefusal refusal;
      refusal.set_slot_id(sid);
      refusal.set_code(CodeName(st.error_code()));
      refusal.set_message(st.error_message());
      cohort->refused.push_back(std::move(refusal));
      if (cohort->refused.size() > kMaxPendingRefusals) {
        return fail(Status(StatusCode::RESOURCE_EXHAUSTED,
                           "more than " + std::to_string(kMaxPendingRefusals) +
                               " refused joins wait for a credit"));
      }
    }
    cohort->cv.notify_all();
  }
  std::lock_guard<std::mutex> lock(mu_);
  cohort->is_client_done = true;
  cohort->is_reader_done = true;
  cohort->cv.notify_all();
}

// The stream is over. Members whose run ended (ENDED) await Finish however it ended: a client
// may break its stream once it has read every end and still call Finish. After a break
// (disconnect, deadline, error) members still running are orphaned: cancelled, and freed as
// their run ends, which for the talker is here. A member whose Finish is waiting ends here and
// is that Finish's to finish. An ended member nobody finishes is the slot TTL's.
void TalkerStage::CloseCohort(const std::shared_ptr<Cohort>& cohort, bool is_broken,
                              Graveyard* graveyard) {
  cohorts_.erase(cohort);
  if (is_broken) {
    for (const auto& slot : cohort->joined) {
      auto it = slots_.find(slot->slot_id);
      if (it == slots_.end() || it->second != slot) continue;
      const SubState sub = SubStateOf(ViewOf(*slot));
      if (sub == SubState::kFinishing) {
        if (!slot->ended) slot->ended = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
        StopSubscription(*slot, graveyard);
      } else if (IsOrphanedByBreak(sub)) {
        slot->ended = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
        StopSubscription(*slot, graveyard);
        slots_.erase(it);
      }
    }
    ended_cv_.notify_all();
  }
  cohort->members.clear();
  cohort->joined.clear();
}

Status TalkerStage::Step(grpc::ServerContext* context,
                         grpc::ServerReaderWriter<v1::StepEvent, v1::StepRequest>* stream) {
  v1::StepRequest first;
  if (!stream->Read(&first)) {
    return InvalidArgument("Step needs a first message joining at least one slot");
  }
  if (first.join().empty()) {
    return InvalidArgument("the first Step message must join at least one slot");
  }
  for (int64_t sid : first.join()) {
    Status st = CheckSlotId(sid);
    if (!st.ok()) return st;
  }
  std::vector<int64_t> join(first.join().begin(), first.join().end());
  std::sort(join.begin(), join.end());
  if (std::adjacent_find(join.begin(), join.end()) != join.end()) {
    return InvalidArgument("join names a slot twice");
  }
  const int64_t credits = first.credits() ? first.credits() : kDefaultWindow;
  if (credits > kMaxWindow) {
    return Status(StatusCode::RESOURCE_EXHAUSTED,
                  "credit window would reach " + std::to_string(credits) +
                      "; the most a Step stream may hold is " + std::to_string(kMaxWindow));
  }
  auto cohort = std::make_shared<Cohort>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (is_shutting_down_) return Status(StatusCode::UNAVAILABLE, "the stage is shutting down");
    std::vector<std::shared_ptr<Slot>> slots;
    for (int64_t sid : first.join()) {  // all or nothing
      std::shared_ptr<Slot> slot;
      Status st = Require(sid, SlotCall::kStep, &slot);
      if (!st.ok()) return st;
      slots.push_back(std::move(slot));
    }
    cohort->credits = credits;
    cohorts_.insert(cohort);
    for (const auto& slot : slots) Enter(cohort, slot);
  }
  std::thread reader([this, stream, cohort] { ReadControls(stream, cohort); });

  Status result = Status::OK;
  bool is_broken = false;
  bool is_reading = false;
  Graveyard graveyard;
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (cohort->error) {
        result = *cohort->error;
        is_broken = true;
        break;
      }
      if (context->IsCancelled()) {
        result = Status(StatusCode::CANCELLED, "the Step stream was cancelled");
        is_broken = true;
        break;
      }
      if (is_shutting_down_) {
        result = Status(StatusCode::UNAVAILABLE, "the stage is shutting down");
        is_broken = true;
        break;
      }
      v1::StepEvent event;
      if (BuildEvent(*cohort, &event)) {
        lock.unlock();
        const bool ok = stream->Write(event);
        lock.lock();
        if (!ok) {
          result = Status(StatusCode::CANCELLED, "the Step stream broke (client gone)");
          is_broken = true;
          break;
        }
        continue;
      }
      if (cohort->is_client_done && cohort->members.empty()) break;
      cohort->cv.wait_for(lock, std::chrono::milliseconds(100));
    }
    CloseCohort(cohort, is_broken, &graveyard);
    is_reading = !cohort->is_reader_done;
  }
  // Cancelling the call unblocks a Read still pending, but the client then sees CANCELLED; a
  // stream its reader failed (a malformed message) has no Read pending and keeps its status.
  if (is_broken && is_reading) context->TryCancel();
  reader.join();
  graveyard.clear();
  return result;
}

// ---- Finish / Reset / Diagnostics / Cancel ------------------------------------------------------

Status TalkerStage::Finish(grpc::ServerContext*, const v1::FinishRequest* req,
                           v1::FinishResponse* out) {
  const v1::FinishReason reason = req->reason();
  if (!v1::FinishReason_IsValid(reason)) {
    return InvalidArgument("reason " + std::to_string(static_cast<int>(reason)) +
                           " is not a FinishReason value");
  }
  Graveyard graveyard;
  {
    std::unique_lock<std::mutex> lock(mu_);
    std::shared_ptr<Slot> slot;
    Status st = Require(req->slot_id(), SlotCall::kFinish, &slot);
    if (!st.ok()) return st;
    slot->is_finishing = true;
    if (!slot->ended) {
      if (slot->state == SlotState::kRunning) {
        if (!slot->stop) slot->stop = v1::FINISH_REASON_CANCELLED;
        if (slot->subscriber) slot->subscriber->Cancel();
        Notify(*slot);
        ended_cv_.wait(lock, [&] { return slot->ended.has_value() || is_shutting_down_; });
        if (!slot->ended) slot->ended = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
        if (reason != v1::FINISH_REASON_UNSPECIFIED &&
            slot->ended->reason == v1::FINISH_REASON_CANCELLED) {
          slot->ended->reason = reason;
        }
      } else {
        slot->ended = RunEnd{reason != v1::FINISH_REASON_UNSPECIFIED
                                 ? reason : v1::FINISH_REASON_CANCELLED, ""};
      }
    }
    if (slot->state != SlotState::kFinished) FinishSlot(*slot, &graveyard);
    out->set_slot_id(slot->slot_id);
    out->set_finish_reason(slot->ended->reason);
    out->set_error(slot->ended->error);
    for (int32_t code : slot->frames) out->add_output_token_ids(code);
    v1::RequestMetrics* m = out->mutable_metrics();
    m->set_prompt_tokens(0);
    m->set_generated_tokens(static_cast<int32_t>(slot->frames.size()));
    if (!slot->frames.empty() && slot->joined_at != Clock::time_point{}) {
      m->set_ttft_ms(std::max(0.0, Ms(slot->first_frame_at - slot->joined_at)));
      const double decode_ms = Ms(slot->last_frame_at - slot->first_frame_at);
      m->set_decode_ms(decode_ms);
      if (decode_ms > 0 && slot->frames.size() > 1) {
        m->set_tokens_per_s(static_cast<double>(slot->frames.size() - 1) * 1000.0 / decode_ms);
      }
    }
  }
  graveyard.clear();
  return Status::OK;
}

Status TalkerStage::Reset(grpc::ServerContext*, const v1::ResetRequest* req,
                          v1::ResetResponse* out) {
  Graveyard graveyard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Slot> slot;
    Status st = Require(req->slot_id(), SlotCall::kReset, &slot);
    if (!st.ok()) return st;
    out->set_existed(slot != nullptr);
    if (!slot) return Status::OK;  // an unknown slot: nothing to drop
    Forget(slot, &graveyard);
  }
  graveyard.clear();
  return Status::OK;
}

Status TalkerStage::Diagnostics(grpc::ServerContext*, const v1::DiagnosticsRequest* req,
                                v1::DiagnosticsResponse* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req->has_slot_id()) {
    std::shared_ptr<Slot> slot;
    Status st = Require(req->slot_id(), SlotCall::kDiagnostics, &slot);
    if (!st.ok()) return st;
    *out->mutable_values() = slot->diagnostics;
    return Status::OK;
  }
  google::protobuf::Struct* v = out->mutable_values();
  Put(v, "stage_id", stage_id_);
  Put(v, "slots", static_cast<double>(slots_.size()));
  google::protobuf::Struct by_state;
  int64_t subscriptions = 0;
  for (SlotState s : {SlotState::kAdmitted, SlotState::kPrepared, SlotState::kRunning,
                      SlotState::kFinished}) {
    Put(&by_state, StateName(s), 0.0);
  }
  for (const auto& [id, slot] : slots_) {
    auto& field = (*by_state.mutable_fields())[StateName(slot->state)];
    field.set_number_value(field.number_value() + 1);
    if (slot->subscriber && !slot->subscriber->is_done()) subscriptions += 1;
  }
  *(*v->mutable_fields())["slots_by_state"].mutable_struct_value() = by_state;
  Put(v, "cohorts", static_cast<double>(cohorts_.size()));
  Put(v, "steps", static_cast<double>(num_steps_));
  Put(v, "frames", static_cast<double>(num_frames_));
  Put(v, "hidden_messages", static_cast<double>(num_hidden_messages_));
  Put(v, "hidden_subscriptions", static_cast<double>(subscriptions));
  (*v->mutable_fields())["draining"].set_bool_value(is_shutting_down_);
  return Status::OK;
}

Status TalkerStage::Cancel(grpc::ServerContext*, const v1::CancelRequest* req,
                           v1::CancelResponse* out) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Slot> slot;
  Status st = Require(req->slot_id(), SlotCall::kCancel, &slot);
  if (!st.ok()) return st;
  out->set_state(ToProto(slot->state));
  if (slot->ended) {
    out->set_was_running(false);
    return Status::OK;
  }
  if (slot->subscriber) slot->subscriber->Cancel();
  if (slot->state == SlotState::kRunning) {
    if (!slot->stop) slot->stop = v1::FINISH_REASON_CANCELLED;
    Notify(*slot);  // ends at the stream's next round
  } else {
    slot->ended = RunEnd{v1::FINISH_REASON_CANCELLED, ""};
    ended_cv_.notify_all();
  }
  out->set_was_running(true);
  return Status::OK;
}

Status TalkerStage::Subscribe(grpc::ServerContext*, const v1::SubscribeRequest* req,
                              grpc::ServerWriter<v1::SubscribeEvent>*) {
  if (req->target_case() == v1::SubscribeRequest::TARGET_NOT_SET ||
      (req->target_case() == v1::SubscribeRequest::kAllRequests && !req->all_requests())) {
    return InvalidArgument("Subscribe needs a request_id or all_requests = true");
  }
  return Status(StatusCode::FAILED_PRECONDITION,
                "the talker declares no subscribable port (its 'audio' frames travel on Step)");
}

}  // namespace talker
