// The talker's slot states and the one table of which slot call is legal in which state.
//
// This mirrors the stage kit's table, services/stage/slot_machine.py (CALLS over the sub-states
// of services/stage/slot.py), and words its refusals the same way, so a client sees the same
// code and the same message from either stage. tests/contract/test_illegal_calls.py holds both
// to the contract's table (DESIGN.md section 3):
//
//   ADMITTED --Prepare--> PREPARED --Step (join)--> RUNNING --Finish--> FINISHED --Reset--> gone
//
// A slot stores one of the contract's four states plus two facts: whether its run ended and
// whether a Finish is waiting for the run to stop. Together they give the sub-state that
// decides legality, as the kit's: a run that ended before Finish (a cancelled ADMITTED or
// PREPARED slot, a RUNNING member whose end was delivered) refuses Prepare and Step; a slot
// being finished allows only Cancel.
//
// Besides the calls, the table says what happens to a slot nobody drives, as the kit's
// TRANSITIONS do. A Step stream that breaks orphans only its members still RUNNING: they are
// cancelled and their end frees them (the kit's ORPHANED sub-state; the talker's run ends at
// once, so it lasts no time here). A member whose run ended (ENDED) waits for Finish however
// its stream ends: a client may break the stream once it has read every end. The slot TTL
// frees a slot nobody touched for that long in any sub-state but a live run (RUNNING,
// FINISHING); that is the backstop for a caller that never calls Finish or Reset.
//
// Nothing here locks or touches a slot: callers pass a SlotView taken under their lock.
#pragma once

#include <cstdint>
#include <string>

#include <grpcpp/grpcpp.h>

namespace talker {

// What a slot stores: the contract's states.
enum class SlotState { kAdmitted, kPrepared, kRunning, kFinished };

// Every call that names a slot ("Step" is a Step stream joining it).
enum class SlotCall { kAdmit, kPrepare, kStep, kCancel, kFinish, kDiagnostics, kReset };

// The sub-state legality depends on (the kit's SlotState, less ORPHANED).
enum class SubState {
  kAdmitted,
  kPrepared,
  kRunning,
  kAdmittedEnded,  // cancelled before Prepare; waits for Finish or Reset
  kPreparedEnded,  // cancelled before it joined; waits for Finish or Reset
  kEnded,          // a member's run ended; waits for Finish
  kFinishing,      // Finish waits for the run to stop
  kFinished,
};

const char* StateName(SlotState state);  // "ADMITTED", ...
const char* CallName(SlotCall call);     // "Admit", ...
const char* SubStateName(SubState sub);  // "ADMITTED_ENDED", ... (as the kit's SlotState)

// What the table needs to know of an existing slot.
struct SlotView {
  SlotState state = SlotState::kAdmitted;
  bool is_ended = false;      // the run ended (before or at Finish)
  std::string ended_reason;   // when is_ended: why, as a reason name ("cancelled", ...)
  bool is_finishing = false;  // a Finish was accepted
};

SubState SubStateOf(const SlotView& slot);

// Whether the table allows `call` on an existing slot in `sub` (Admit never is).
bool IsAllowed(SlotCall call, SubState sub);

// The calls allowed in `sub`, in table order, comma-separated ("Cancel, Finish").
std::string AllowedCalls(SubState sub);

// Whether a broken Step stream orphans a member in `sub` (the kit's ORPHAN move): cancels it
// and frees it at its end. Only RUNNING; an ENDED member waits for Finish, and one being
// finished is its Finish's.
bool IsOrphanedByBreak(SubState sub);

// Whether the slot TTL may free a slot in `sub` nobody touched for that long (the kit's
// EXPIRE move): every sub-state but a live run (RUNNING, FINISHING).
bool MayExpire(SubState sub);

// INVALID_ARGUMENT for a negative slot id, else OK.
grpc::Status CheckSlotId(int64_t slot_id);

// The one legality check of a slot call: OK when `call` may go ahead on slot `slot_id`, whose
// view is `slot` (nullptr: no such slot). Else, and without changing anything:
//   a negative id                                        INVALID_ARGUMENT
//   no such slot (Admit and Reset go ahead: a Reset of
//   an unknown slot is an idempotent no-op)              NOT_FOUND
//   Admit into an existing slot                          FAILED_PRECONDITION
//   a call the sub-state does not allow (a second
//   Finish included)                                     FAILED_PRECONDITION, naming the state
//                                                        and the calls allowed now
grpc::Status CheckCall(SlotCall call, int64_t slot_id, const SlotView* slot);

}  // namespace talker
