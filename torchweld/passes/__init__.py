"""FX graph passes users may run themselves (weld runs some of them too):

    from torchweld.passes import fuse_conv_bn
    folded = fuse_conv_bn(model.eval())   # a GraphModule with each conv + batch norm folded into one conv

The names here are the passes (functions), not their modules: `torchweld.passes.fuse_conv_bn`
is the function; its module is imported as `from torchweld.passes.fuse_conv_bn import ...`."""
from torchweld.passes.channels_last import to_channels_last
from torchweld.passes.fuse_attention import fuse_attention
from torchweld.passes.fuse_conv_bn import fuse_conv_bn

__all__ = ["fuse_attention", "fuse_conv_bn", "to_channels_last"]
