"""Task environments: the multi-turn calculator task, its sandboxed tool and tokenizer."""
from k3.envs.calc_task import CalculatorEnv, Episode, Task, heldout_tasks, train_tasks
from k3.envs.calculator import CalcError, evaluate
from k3.envs.tokenizer import CalcTokenizer

__all__ = ["CalcError", "CalcTokenizer", "CalculatorEnv", "Episode", "Task", "evaluate", "heldout_tasks",
           "train_tasks"]
