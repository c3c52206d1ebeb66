#include "slot_machine.h"

#include <array>

namespace talker {
namespace {

using grpc::Status;
using grpc::StatusCode;

constexpr size_t kNumStates = 4;

struct Rule {
  SlotCall call;
  std::array<bool, kNumStates> allowed;  // by SlotState: ADMITTED, PREPARED, RUNNING, FINISHED
  bool needs_live_run;                   // refused once the run ended
};

// The table: one row per SlotCall, in its order (refusals list allowed calls in it).
//                     ADMITTED PREPARED RUNNING FINISHED   live run
constexpr std::array<Rule, 7> kTable = {{
    {SlotCall::kAdmit, {false, false, false, false}, false},
    {SlotCall::kPrepare, {true, false, false, false}, true},
    {SlotCall::kStep, {false, true, false, false}, true},
    {SlotCall::kCancel, {true, true, true, false}, false},
    {SlotCall::kFinish, {true, true, true, false}, false},
    {SlotCall::kDiagnostics, {false, false, false, true}, false},
    {SlotCall::kReset, {true, true, false, true}, false},
}};

constexpr bool IsIndexedByCall() {
  for (size_t i = 0; i < kTable.size(); ++i) {
    if (static_cast<size_t>(kTable[i].call) != i) return false;
  }
  return true;
}
static_assert(IsIndexedByCall(), "kTable's rows follow SlotCall's order");

const Rule& RuleOf(SlotCall call) { return kTable[static_cast<size_t>(call)]; }

std::string SlotName(int64_t slot_id) { return "slot " + std::to_string(slot_id); }

}  // namespace

const char* StateName(SlotState state) {
  switch (state) {
    case SlotState::kAdmitted: return "ADMITTED";
    case SlotState::kPrepared: return "PREPARED";
    case SlotState::kRunning: return "RUNNING";
    case SlotState::kFinished: return "FINISHED";
  }
  return "UNSPECIFIED";
}

const char* CallName(SlotCall call) {
  switch (call) {
    case SlotCall::kAdmit: return "Admit";
    case SlotCall::kPrepare: return "Prepare";
    case SlotCall::kStep: return "Step";
    case SlotCall::kCancel: return "Cancel";
    case SlotCall::kFinish: return "Finish";
    case SlotCall::kDiagnostics: return "Diagnostics";
    case SlotCall::kReset: return "Reset";
  }
  return "?";
}

bool IsAllowed(SlotCall call, SlotState state, bool is_ended) {
  const Rule& rule = RuleOf(call);
  return rule.allowed[static_cast<size_t>(state)] && !(is_ended && rule.needs_live_run);
}

std::string AllowedCalls(SlotState state, bool is_ended) {
  std::string out;
  for (const Rule& rule : kTable) {
    if (!IsAllowed(rule.call, state, is_ended)) continue;
    if (!out.empty()) out += ", ";
    out += CallName(rule.call);
  }
  return out;
}

Status CheckSlotId(int64_t slot_id) {
  if (slot_id < 0) {
    return Status(StatusCode::INVALID_ARGUMENT,
                  "slot id " + std::to_string(slot_id) + " is negative; slot ids are >= 0");
  }
  return Status::OK;
}

Status CheckCall(SlotCall call, int64_t slot_id, const SlotView* slot) {
  Status st = CheckSlotId(slot_id);
  if (!st.ok()) return st;
  const std::string name = CallName(call);
  if (slot == nullptr) {
    if (call == SlotCall::kAdmit || call == SlotCall::kReset) return Status::OK;
    return Status(StatusCode::NOT_FOUND, name + ": " + SlotName(slot_id) + " does not exist");
  }
  const std::string state = StateName(slot->state);
  if (call == SlotCall::kAdmit) {
    return Status(StatusCode::FAILED_PRECONDITION,
                  "Admit is not allowed: " + SlotName(slot_id) + " already exists in state " +
                      state + "; Reset it before admitting a new request into it");
  }
  if (!IsAllowed(call, slot->state, slot->is_ended)) {
    const std::string how =
        slot->is_ended ? " and its run ended (" + slot->ended_reason + ")" : "";
    return Status(StatusCode::FAILED_PRECONDITION,
                  name + " is not allowed: " + SlotName(slot_id) + " is " + state + how +
                      "; allowed now: " + AllowedCalls(slot->state, slot->is_ended));
  }
  if (call == SlotCall::kFinish && slot->is_finishing) {
    return Status(StatusCode::FAILED_PRECONDITION,
                  "Finish is not allowed: " + SlotName(slot_id) + " is " + state +
                      " and already being finished");
  }
  return Status::OK;
}

}  // namespace talker
