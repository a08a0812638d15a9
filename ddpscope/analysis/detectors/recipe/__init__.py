"""Recipe checks: the rules of the standard DDP recipe that PyTorch does not enforce.

One module per check, each judging what the ranks' recipe probe
(ddpscope/hooks/recipe.py) reports: ``global_batch``, ``checkpoint_all_ranks``,
``rank0_only_collective`` (collectives.py), ``dataparallel``,
``batchnorm_small_batch`` (batchnorm.py), ``no_destroy_process_group``
(process_group.py), ``device_mismatch`` (device.py),
``accumulate_without_no_sync`` (accumulation.py), ``forward_bypasses_ddp``
(bypass.py) and ``gradients_reduced_twice`` (manual_allreduce.py). common.py
and setup.py are what they share; no torch here.
"""
