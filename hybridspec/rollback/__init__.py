"""The rollback-correctness suite as a library, run by `tests/test_spec_*.py`
and by `hybridspec check`: `checks` (the checks and `run_suite`), `models`
(tiny random models, perturbed copies, workloads), `observer` (per-round
state comparison and fault injection), `forcing` (a drafter wrapper that
forces the rejections a check needs), `tree_checks` (the suite's tree mode)."""
from hybridspec.rollback.checks import (GAMMAS, POLICIES, CheckFailure, CheckResult, bad_input_checks, batch_invariance, failed_round,
                     run_suite, speculative_parity, stop_inside_accepted_run)
from hybridspec.rollback.forcing import ForcedRejections, Rejection, force_rejections
from hybridspec.rollback.models import (OutOfVocabDrafter, ScriptedDrafter, branching_prompts, params_fingerprint,
                     perturbed_copy, plain_outputs, random_mtp, sampled_params, tiny_model, workload)
from hybridspec.rollback.tree_checks import tree_batch_invariance, tree_suite
from hybridspec.rollback.observer import FAULT_SITES, InjectedFault, RoundObserver, install_fault, witness_bookkeeping

__all__ = ["FAULT_SITES", "GAMMAS", "POLICIES", "CheckFailure", "CheckResult", "ForcedRejections", "InjectedFault",
           "OutOfVocabDrafter", "Rejection", "RoundObserver", "ScriptedDrafter", "bad_input_checks", "batch_invariance",
           "branching_prompts", "failed_round",
           "force_rejections", "install_fault", "params_fingerprint", "perturbed_copy", "plain_outputs", "random_mtp", "run_suite",
           "sampled_params", "speculative_parity", "stop_inside_accepted_run", "tiny_model", "tree_batch_invariance",
           "tree_suite", "witness_bookkeeping", "workload"]
