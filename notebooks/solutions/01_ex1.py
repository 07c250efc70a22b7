# Solution to notebook 01, exercise 1: where do the FLOPs go?
# conv2 has 64 x 24 x 24 outputs; each is a sum of 32 x 3 x 3 products: one multiply and one add each.
conv2_flops = 2 * (64 * 24 * 24) * (32 * 3 * 3)
# fc1 multiplies a 9,216-vector by a 9,216 x 128 matrix: 2 FLOPs per weight.
fc1_flops = 2 * 9216 * 128
# fc1 holds 1.18 M of the 1.2 M parameters but costs 2.4 MFLOP; conv2 holds 18 k parameters and costs 21 MFLOP:
# a convolution reuses each weight at every one of the 24 x 24 positions.
