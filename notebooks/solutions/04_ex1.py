# Solution to notebook 04, exercise 1: rescue an old checkpoint.
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from lesson import models

state = torch.load(PREFIXED, map_location="cpu", weights_only=True)  # keys 'module.conv1.weight', ...
consume_prefix_in_state_dict_if_present(state, "module.")  # strips the prefix, in memory only
rescued = models.Net(dropout=False)
print(rescued.load_state_dict(state))  # <All keys matched successfully>
