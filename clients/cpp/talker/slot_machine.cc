#include "slot_machine.h"

#include <array>

namespace talker {
namespace {

using grpc::Status;
using grpc::StatusCode;

constexpr size_t kNumSubStates = 8;

struct Rule {
  SlotCall call;
  std::array<bool, kNumSubStates> allowed;  // by SubState, in its order
};

// The table: one row per SlotCall, in its order (refusals list allowed calls in it).
//  ADMITTED PREPARED RUNNING ADMITTED_ENDED PREPARED_ENDED ENDED FINISHING FINISHED
constexpr std::array<Rule, 7> kTable = {{
    {SlotCall::kAdmit, {false, false, false, false, false, false, false, false}},
    {SlotCall::kPrepare, {true, false, false, false, false, false, false, false}},
    {SlotCall::kStep, {false, true, false, false, false, false, false, false}},
    {SlotCall::kCancel, {true, true, true, true, true, true, true, false}},
    {SlotCall::kFinish, {true, true, true, true, true, true, false, false}},
    {SlotCall::kDiagnostics, {false, false, false, false, false, false, false, true}},
    {SlotCall::kReset, {true, true, false, true, true, false, false, true}},
}};

// What happens to a slot nobody drives, by SubState (the kit's TRANSITIONS[ORPHAN] and
// TRANSITIONS[EXPIRE], less ORPHANED).
//  ADMITTED PREPARED RUNNING ADMITTED_ENDED PREPARED_ENDED ENDED FINISHING FINISHED
constexpr std::array<bool, kNumSubStates> kOrphanedByBreak = {
    false, false, true, false, false, false, false, false};
constexpr std::array<bool, kNumSubStates> kMayExpire = {
    true, true, false, true, true, true, false, true};

constexpr bool IsIndexedByCall() {
  for (size_t i = 0; i < kTable.size(); ++i) {
    if (static_cast<size_t>(kTable[i].call) != i) return false;
  }
  return true;
}
static_assert(IsIndexedByCall(), "kTable's rows follow SlotCall's order");

const Rule& RuleOf(SlotCall call) { return kTable[static_cast<size_t>(call)]; }

std::string SlotName(int64_t slot_id) { return "slot " + std::to_string(slot_id); }

// What a refusal adds to the state's name: a Finish under way, or how the run ended.
std::string Why(const SlotView& slot) {
  if (SubStateOf(slot) == SubState::kFinishing) return " and already being finished";
  if (slot.is_ended) return " and its run ended (" + slot.ended_reason + ")";
  return "";
}

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

const char* SubStateName(SubState sub) {
  switch (sub) {
    case SubState::kAdmitted: return "ADMITTED";
    case SubState::kPrepared: return "PREPARED";
    case SubState::kRunning: return "RUNNING";
    case SubState::kAdmittedEnded: return "ADMITTED_ENDED";
    case SubState::kPreparedEnded: return "PREPARED_ENDED";
    case SubState::kEnded: return "ENDED";
    case SubState::kFinishing: return "FINISHING";
    case SubState::kFinished: return "FINISHED";
  }
  return "?";
}

SubState SubStateOf(const SlotView& slot) {
  if (slot.state == SlotState::kFinished) return SubState::kFinished;
  if (slot.is_finishing) return SubState::kFinishing;
  switch (slot.state) {
    case SlotState::kAdmitted:
      return slot.is_ended ? SubState::kAdmittedEnded : SubState::kAdmitted;
    case SlotState::kPrepared:
      return slot.is_ended ? SubState::kPreparedEnded : SubState::kPrepared;
    default:
      return slot.is_ended ? SubState::kEnded : SubState::kRunning;
  }
}

bool IsAllowed(SlotCall call, SubState sub) {
  return RuleOf(call).allowed[static_cast<size_t>(sub)];
}

bool IsOrphanedByBreak(SubState sub) { return kOrphanedByBreak[static_cast<size_t>(sub)]; }

bool MayExpire(SubState sub) { return kMayExpire[static_cast<size_t>(sub)]; }

std::string AllowedCalls(SubState sub) {
  std::string out;
  for (const Rule& rule : kTable) {
    if (!IsAllowed(rule.call, sub)) continue;
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
  const SubState sub = SubStateOf(*slot);
  if (!IsAllowed(call, sub)) {
    return Status(StatusCode::FAILED_PRECONDITION,
                  name + " is not allowed: " + SlotName(slot_id) + " is " + state + Why(*slot) +
                      "; allowed now: " + AllowedCalls(sub));
  }
  return Status::OK;
}

}  // namespace talker
