/* End of one (ISA, scalar type) instantiation: the macros are consumed, the
   next instantiation redefines them. */
#undef BQ
#undef BK
#undef T
#undef V
#undef VW
#undef NVQ
#undef JR
#undef NVO
#undef IR
#undef FN
#undef V_ZERO
#undef V_SET1
#undef V_LOAD
#undef V_STORE
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_MAX
#undef V_FMA
#undef V_EXP
#undef V_NEG_INF_TO_ZERO
#undef V_HSUM
#undef V_HSUM4
#undef V_MARK_HIDDEN
#undef V_TRANSPOSE
#undef V_EXP2
#undef VM
#undef V_VISIBLE
#undef V_FMA_VISIBLE
#ifdef V_LOAD_HALF
#undef V_LOAD_HALF
#endif
#ifdef V_LOAD_BF16
#undef V_LOAD_BF16
#endif
#ifdef V_STORE_BF16
#undef V_STORE_BF16
#endif
#ifdef V_STORE_HALF
#undef V_STORE_HALF
#endif
#ifdef V_LOAD_I8
#undef V_LOAD_I8
#endif
#ifdef V_LOAD_U4
#undef V_LOAD_U4
#endif
#undef MH_I4_SPLIT
#ifdef V_LOAD_U4_SPLIT
#undef V_LOAD_U4_SPLIT
#undef V_SPLIT
#undef V_UNSPLIT
#endif
#ifdef S_HALF_TO_FLOAT
#undef S_HALF_TO_FLOAT
#endif
#ifdef S4_HALF_TO_FLOAT
#undef S4_HALF_TO_FLOAT
#endif
#undef MH_HALF_TO_FLOAT
#ifdef V_DPBF16
#undef V_DPBF16
#undef VP
#undef VP_LOAD
#undef VP_STORE
#undef VP_SET1
#undef VP_LOW
#undef VP_HIGH
#undef VP_AS_V
#undef VP_PAIR
#undef VP_INTERLEAVE
#endif
