"""The stage kit: what every Python stage service shares (no model code, no grpc below the
servicer).

    ending.py        FinishReason: why a request's run ended (the contract's enum)
    slot_machine.py  SlotState, the one transition table and SlotMachine, the only code that
                     creates, moves and frees slots
    slot.py          Slot = the immutable request + its run record + its telemetry
    cohort.py        Cohort: one Step stream's members, its credit window, members' windows
    decode_thread.py the one thread that steps the stage's stepper
    step_loop.py     StepLoop: the decode loop over a narrow Stepper protocol
    core.py          StageCore: the slot lifecycle of the contract over the kit
    servicer.py      the generic half of a Stage servicer (Prepare, Step, Cancel, Finish,
                     Diagnostics, Reset)
"""
