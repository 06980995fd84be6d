// The grouped GEMM's Hopper kernel for the kRowsKN layout (grouped_gemm_sm90.h).
#include "gemm/grouped_gemm_sm90.cuh"

FUSEDLAYERS_GROUPED_GEMM_SM90(fusedlayers::Sm90Layout::kRowsKN);
