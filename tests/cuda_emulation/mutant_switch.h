// TEST INFRASTRUCTURE: the switch of the mutation check's schemata (tests/cuda_emulation/
// mutations.py). The emulation's kernels are compiled from a copy of logits_processor/ in which
// each planted bug is written beside the code it mutates, `LP_MUTANT(id) ? bug : code`, and this
// header is force-included (-include) into them: one build holds every mutant, and the process
// picks at most one, LP_MUTANT=<id> in its environment (runtime.cpp reads it once, before any
// launch); without it every switch is off and the kernels compute what the sources say.
#pragma once

namespace cuda_emulation {
extern int active_mutant;  // 0: none
}  // namespace cuda_emulation

#define LP_MUTANT(id) (::cuda_emulation::active_mutant == (id))
