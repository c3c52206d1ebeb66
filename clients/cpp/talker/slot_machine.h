// The talker's slot states and the one table of which slot call is legal in which state.
//
// This mirrors the stage kit's transition table, services/stage/slot_machine.py (the Python
// runner's llm_runner_svc/stage/slots.py until the kit replaces it: ALLOWED plus
// _NEEDS_LIVE_RUN), and words its refusals the same way, so a client sees the same code and the
// same message from either stage. tests/contract/test_illegal_calls.py holds both to the
// contract's table (DESIGN.md section 3):
//
//   ADMITTED  --Prepare-->  PREPARED  --Step (join)-->  RUNNING  --Finish-->  FINISHED  --Reset-->
//
// A run may end before Finish (a cancelled ADMITTED / PREPARED slot, a RUNNING member whose
// stream delivered its end): the slot keeps its state with the "run ended" sub-state, in which
// Prepare and Step are refused and everything else the state allows stays allowed. The talker
// has no orphaned sub-state: a member of a Step stream that breaks is finished and dropped at
// once.
//
// Nothing here locks or touches a slot: callers pass a SlotView taken under their lock.
#pragma once

#include <cstdint>
#include <string>

#include <grpcpp/grpcpp.h>

namespace talker {

enum class SlotState { kAdmitted, kPrepared, kRunning, kFinished };

// Every call that names a slot ("Step" is a Step stream joining it).
enum class SlotCall { kAdmit, kPrepare, kStep, kCancel, kFinish, kDiagnostics, kReset };

const char* StateName(SlotState state);  // "ADMITTED", ...
const char* CallName(SlotCall call);     // "Admit", ...

// What the table needs to know of an existing slot.
struct SlotView {
  SlotState state = SlotState::kAdmitted;
  bool is_ended = false;      // the run ended (before or at Finish)
  std::string ended_reason;   // when is_ended: why, as a reason name ("cancelled", ...)
  bool is_finishing = false;  // a Finish is waiting for the run to stop
};

// Whether the table allows `call` on an existing slot in `state` (Admit never is).
bool IsAllowed(SlotCall call, SlotState state, bool is_ended);

// The calls allowed now, in table order, comma-separated ("Cancel, Finish").
std::string AllowedCalls(SlotState state, bool is_ended);

// INVALID_ARGUMENT for a negative slot id, else OK.
grpc::Status CheckSlotId(int64_t slot_id);

// The one legality check of a slot call: OK when `call` may go ahead on slot `slot_id`, whose
// view is `slot` (nullptr: no such slot). Else, and without changing anything:
//   a negative id                                        INVALID_ARGUMENT
//   no such slot (Admit and Reset go ahead: a Reset of
//   an unknown slot is an idempotent no-op)              NOT_FOUND
//   Admit into an existing slot                          FAILED_PRECONDITION
//   a call the state (or its ended run) does not allow   FAILED_PRECONDITION, naming the state
//                                                        and the calls allowed now
//   a second Finish while the first waits for the run    FAILED_PRECONDITION
grpc::Status CheckCall(SlotCall call, int64_t slot_id, const SlotView* slot);

}  // namespace talker
