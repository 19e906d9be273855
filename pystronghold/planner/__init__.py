"""The planner: a cost model of the layer-window runtime (see docs/DESIGN.md, "The planner").

``make_plan(config, workload, hardware)`` predicts the window W, device/host/disk bytes and the
step time of training ``config`` on ``hardware``; ``largest_models`` finds the most layers that
train at a few widths. ``pystronghold plan`` prints both.
"""

from pystronghold.planner.cost import BlockCosts, Workload, block_costs
from pystronghold.planner.hardware import GPU, GPUS, Hardware, gpu_preset
from pystronghold.planner.memory import DeviceMemory, HostMemory
from pystronghold.planner.plan import LargestModel, Plan, largest_layers, largest_models, make_plan
from pystronghold.planner.report import format_plan, plan_to_dict
from pystronghold.planner.timeline import StepTime, choose_window, simulate_step

__all__ = ["GPU", "GPUS", "Hardware", "gpu_preset", "Workload", "BlockCosts", "block_costs",
           "StepTime", "simulate_step", "choose_window", "Plan", "DeviceMemory", "HostMemory",
           "LargestModel", "make_plan", "largest_layers", "largest_models", "format_plan",
           "plan_to_dict"]
