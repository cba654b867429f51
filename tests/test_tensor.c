/* test_tensor.c — bf16/f16 conversions on exact cases (ties to even, NaN,
 * Inf, subnormals, overflow, negative zero), round-to-nearest on random
 * values, tensor copies with casts, views, wrapped memory. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static float flt(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static uint64_t rng = 0xBF58476D1CE4E5B9ull;
static uint64_t next_u64(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

/* --------------------------------------------------------------------- bf16 */

LZ_TEST(tensor_bf16_exact_cases) {
  CHECK_EQ_INT(lz_f32_to_bf16(1.0f), 0x3f80);
  CHECK_EQ_INT(lz_f32_to_bf16(-2.0f), 0xc000);
  /* Ties go to the even neighbour, in both directions. */
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x3f808000)), 0x3f80); /* 1 + 2^-8: down to even */
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x3f818000)), 0x3f82); /* up to even */
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0xbf808000)), 0xbf80);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0xbf818000)), 0xbf82);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x3f808001)), 0x3f81); /* just past the tie */
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x3f817fff)), 0x3f81); /* just short of it */
  /* Inf, NaN (quiet or signalling, payload only in the dropped bits). */
  CHECK_EQ_INT(lz_f32_to_bf16(INFINITY), 0x7f80);
  CHECK_EQ_INT(lz_f32_to_bf16(-INFINITY), 0xff80);
  uint16_t n1 = lz_f32_to_bf16(NAN), n2 = lz_f32_to_bf16(flt(0x7f800001)),
           n3 = lz_f32_to_bf16(flt(0xff80ffff));
  CHECK((n1 & 0x7f80) == 0x7f80 && (n1 & 0x7f) != 0);
  CHECK((n2 & 0x7f80) == 0x7f80 && (n2 & 0x7f) != 0);
  CHECK((n3 & 0x7f80) == 0x7f80 && (n3 & 0x7f) != 0 && (n3 & 0x8000));
  CHECK(isnan(lz_bf16_to_f32(n2)));
  /* Overflow: the largest float rounds up to Inf; the largest bf16 stays. */
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x7f7fffff)), 0x7f80);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x7f7f7fff)), 0x7f7f);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0xff7fffff)), 0xff80);
  /* Zeros and subnormals. */
  CHECK_EQ_INT(lz_f32_to_bf16(-0.0f), 0x8000);
  CHECK(signbit(lz_bf16_to_f32(0x8000)) && lz_bf16_to_f32(0x8000) == 0.0f);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x00010000)), 0x0001);
  CHECK_EQ_INT(lz_f32_to_bf16(flt(0x00008000)), 0x0000); /* tie, to even 0 */
  CHECK(lz_bf16_to_f32(0x3f80) == 1.0f);
  CHECK(lz_bf16_to_f32(0x7f80) == INFINITY);
  CHECK(bits(lz_bf16_to_f32(0x0001)) == 0x00010000);
}

/* Whether every 16-bit pattern of magnitude up to inf (Inf's bits: the
 * non-NaN ones) comes back from a trip through f32. */
static int round_trips(uint16_t (*to16)(float), float (*to32)(uint16_t), uint32_t inf) {
  int ok = 1;
  for (uint32_t h = 0; h < 0x10000; h++)
    if ((h & 0x7fff) <= inf) ok &= to16(to32((uint16_t)h)) == h;
  return ok;
}

/* Every non-NaN bf16 survives a trip through f32; random floats go to the
 * nearest bf16, ties to even. */
LZ_TEST(tensor_bf16_round_trip_and_nearest) {
  int ok = round_trips(lz_f32_to_bf16, lz_bf16_to_f32, 0x7f80);
  CHECK(ok);
  for (int k = 0; k < 200000; k++) {
    uint32_t u = (uint32_t)next_u64();
    if ((u & 0x7f800000) == 0x7f800000) continue; /* Inf, NaN */
    float x = flt(u);
    uint16_t h = lz_f32_to_bf16(x);
    uint16_t mag = h & 0x7fff;
    ok &= (h & 0x8000) == ((u >> 16) & 0x8000);
    if (mag == 0x7f80) { /* rounded to Inf: must be past the largest finite + half ulp */
      ok &= fabs((double)x) >= 0x1.ffp127;
      continue;
    }
    double a = fabs((double)x), d = fabs(a - lz_bf16_to_f32(mag));
    if (mag > 0) {
      double dn = fabs(a - lz_bf16_to_f32((uint16_t)(mag - 1)));
      ok &= d < dn || (d == dn && !(mag & 1));
    }
    if (mag < 0x7f7f) {
      double up = fabs(a - lz_bf16_to_f32((uint16_t)(mag + 1)));
      ok &= d < up || (d == up && !(mag & 1));
    }
  }
  CHECK(ok);
}

/* ---------------------------------------------------------------------- f16 */

LZ_TEST(tensor_f16_exact_cases) {
  CHECK_EQ_INT(lz_f32_to_f16(1.0f), 0x3c00);
  CHECK_EQ_INT(lz_f32_to_f16(-2.0f), 0xc000);
  /* Normal ties to even, both directions. */
  CHECK_EQ_INT(lz_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  CHECK_EQ_INT(lz_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  CHECK_EQ_INT(lz_f32_to_f16(-(1.0f + 0x1p-11f)), 0xbc00);
  /* Overflow: 65504 is the largest half; 65520 is the tie with 2^16 and goes
   * to Inf (even); just below it rounds down. */
  CHECK_EQ_INT(lz_f32_to_f16(65504.0f), 0x7bff);
  CHECK_EQ_INT(lz_f32_to_f16(65519.99f), 0x7bff);
  CHECK_EQ_INT(lz_f32_to_f16(nextafterf(65520.0f, 0.0f)), 0x7bff);
  CHECK_EQ_INT(lz_f32_to_f16(65520.0f), 0x7c00);
  CHECK_EQ_INT(lz_f32_to_f16(-65520.0f), 0xfc00);
  CHECK_EQ_INT(lz_f32_to_f16(1e10f), 0x7c00);
  CHECK_EQ_INT(lz_f32_to_f16(flt(0x7f7fffff)), 0x7c00);
  CHECK_EQ_INT(lz_f32_to_f16(INFINITY), 0x7c00);
  CHECK_EQ_INT(lz_f32_to_f16(-INFINITY), 0xfc00);
  uint16_t n1 = lz_f32_to_f16(NAN), n2 = lz_f32_to_f16(flt(0x7f800001)),
           n3 = lz_f32_to_f16(flt(0xffc00000));
  CHECK((n1 & 0x7c00) == 0x7c00 && (n1 & 0x3ff) != 0);
  CHECK((n2 & 0x7c00) == 0x7c00 && (n2 & 0x3ff) != 0); /* payload below f16's bits */
  CHECK((n3 & 0x7c00) == 0x7c00 && (n3 & 0x3ff) != 0 && (n3 & 0x8000));
  CHECK(isnan(lz_f16_to_f32(0x7e00)) && isnan(lz_f16_to_f32(0x7c01)));
  CHECK(lz_f16_to_f32(0x7c00) == INFINITY && lz_f16_to_f32(0xfc00) == -INFINITY);
  CHECK(lz_f16_to_f32(0x7bff) == 65504.0f);
  /* Subnormals, in units of 2^-24. */
  CHECK_EQ_INT(lz_f32_to_f16(0x1p-24f), 0x0001);                /* smallest */
  CHECK_EQ_INT(lz_f32_to_f16(-0x1p-24f), 0x8001);
  CHECK_EQ_INT(lz_f32_to_f16(1023 * 0x1p-24f), 0x03ff);         /* largest */
  CHECK_EQ_INT(lz_f32_to_f16(0x1p-14f), 0x0400);                /* smallest normal */
  CHECK_EQ_INT(lz_f32_to_f16(1023.5f * 0x1p-24f), 0x0400);      /* tie: 0x3ff odd, up */
  CHECK_EQ_INT(lz_f32_to_f16(0x1p-25f), 0x0000);                /* tie with 0: to 0 */
  CHECK_EQ_INT(lz_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
  CHECK_EQ_INT(lz_f32_to_f16(1.5f * 0x1p-24f), 0x0002);         /* tie 1|2: to 2 */
  CHECK_EQ_INT(lz_f32_to_f16(2.5f * 0x1p-24f), 0x0002);         /* tie 2|3: to 2 */
  CHECK_EQ_INT(lz_f32_to_f16(2.5001f * 0x1p-24f), 0x0003);
  CHECK_EQ_INT(lz_f32_to_f16(1e-30f), 0x0000);
  CHECK_EQ_INT(lz_f32_to_f16(flt(0x00000001)), 0x0000);         /* f32 subnormal */
  CHECK(lz_f16_to_f32(0x0001) == 0x1p-24f);
  CHECK(lz_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
  CHECK(lz_f16_to_f32(0x8001) == -0x1p-24f);
  /* Negative zero. */
  CHECK_EQ_INT(lz_f32_to_f16(-0.0f), 0x8000);
  CHECK_EQ_INT(lz_f32_to_f16(-1e-30f), 0x8000);
  CHECK(signbit(lz_f16_to_f32(0x8000)) && lz_f16_to_f32(0x8000) == 0.0f);
}

LZ_TEST(tensor_f16_round_trip_and_nearest) {
  int ok = round_trips(lz_f32_to_f16, lz_f16_to_f32, 0x7c00);
  CHECK(ok);
  for (int k = 0; k < 200000; k++) {
    /* Exponents from 2^-27 to 2^16: zero, subnormal, normal and overflow. */
    uint64_t r = next_u64();
    uint32_t e = 100 + (uint32_t)(r % 44);
    uint32_t u = ((uint32_t)(r >> 8) & 0x807fffffu) | (e << 23);
    float x = flt(u);
    uint16_t h = lz_f32_to_f16(x), mag = h & 0x7fff;
    ok &= (h & 0x8000) == ((u >> 16) & 0x8000);
    double a = fabs((double)x);
    if (mag == 0x7c00) {
      ok &= a >= 65520.0;
      continue;
    }
    double d = fabs(a - lz_f16_to_f32(mag));
    if (mag > 0) {
      double dn = fabs(a - lz_f16_to_f32((uint16_t)(mag - 1)));
      ok &= d < dn || (d == dn && !(mag & 1));
    }
    double up = mag < 0x7bff ? fabs(a - lz_f16_to_f32((uint16_t)(mag + 1))) : fabs(a - 65536.0);
    ok &= d < up || (d == up && !(mag & 1));
  }
  CHECK(ok);
}

/* ------------------------------------------------------------------ tensors */

LZ_TEST(tensor_copy_casts) {
  const int64_t n = 3 * 65536 + 7, s1[1] = {n}; /* threaded blocks plus a tail */
  lz_tensor *f = NULL, *b = NULL, *h = NULL, *back = NULL, *i32 = NULL, *small = NULL;
  CHECK_OK(lz_tensor_new(&f, LZ_F32, 1, s1, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_new(&b, LZ_BF16, 1, s1, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_new(&h, LZ_F16, 1, s1, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_new(&back, LZ_F32, 1, s1, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_new(&i32, LZ_I32, 1, s1, LZ_MEM_WORKSPACE));
  const int64_t s5[1] = {5};
  CHECK_OK(lz_tensor_new(&small, LZ_F32, 1, s5, LZ_MEM_WORKSPACE));
  float *fp = f->data, *bp = back->data;
  for (int64_t i = 0; i < n; i++) fp[i] = flt((uint32_t)next_u64() & 0xbfffffffu); /* finite */
  int ok = 1;

  CHECK_OK(lz_tensor_copy(b, f));
  for (int64_t i = 0; i < n; i++) ok &= ((uint16_t *)b->data)[i] == lz_f32_to_bf16(fp[i]);
  CHECK_OK(lz_tensor_copy(back, b));
  for (int64_t i = 0; i < n; i++) ok &= bp[i] == lz_bf16_to_f32(((uint16_t *)b->data)[i]);
  CHECK_OK(lz_tensor_copy(h, f));
  for (int64_t i = 0; i < n; i++) ok &= ((uint16_t *)h->data)[i] == lz_f32_to_f16(fp[i]);
  CHECK_OK(lz_tensor_copy(back, h));
  for (int64_t i = 0; i < n; i++) ok &= bp[i] == lz_f16_to_f32(((uint16_t *)h->data)[i]);
  /* bf16 -> f16 goes through f32 exactly, so it rounds once. */
  CHECK_OK(lz_tensor_copy(h, b));
  for (int64_t i = 0; i < n; i++)
    ok &= ((uint16_t *)h->data)[i] == lz_f32_to_f16(lz_bf16_to_f32(((uint16_t *)b->data)[i]));
  /* Same dtype: a plain copy, any dtype. */
  CHECK_OK(lz_tensor_copy(back, f));
  ok &= memcmp(back->data, f->data, sizeof(float) * n) == 0;
  CHECK(ok);

  CHECK_ERR(lz_tensor_copy(i32, f), LZ_ERR_INVALID,
            "tensor_copy: cannot convert f32[196615] into i32[196615]");
  CHECK_ERR(lz_tensor_copy(small, f), LZ_ERR_INVALID,
            "tensor_copy: dst is f32[5] (5 elements), expected 196615 elements");
  CHECK_ERR(lz_tensor_copy(NULL, f), LZ_ERR_INVALID, "tensor_copy: dst is missing");
  lz_tensor_free(f), lz_tensor_free(b), lz_tensor_free(h), lz_tensor_free(back);
  lz_tensor_free(i32), lz_tensor_free(small);
}

LZ_TEST(tensor_views) {
  const int64_t s[2] = {4, 6};
  const int64_t before = lz_mem_current(LZ_MEM_PARAMS);
  lz_tensor *base = NULL, *v = NULL, *vv = NULL, *bad = (lz_tensor *)1;
  CHECK_OK(lz_tensor_new(&base, LZ_F32, 2, s, LZ_MEM_PARAMS));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_PARAMS) - before, 4 * 6 * 4);
  float *d = base->data;
  for (int i = 0; i < 24; i++) d[i] = (float)i;

  const int64_t vs[2] = {2, 6};
  CHECK_OK(lz_tensor_view(&v, base, 6, 2, vs));
  CHECK(v->data == d + 6);
  CHECK(v->storage == base->storage);
  CHECK(v->ndim == 2 && v->shape[0] == 2 && v->shape[1] == 6 && v->dtype == LZ_F32);
  ((float *)v->data)[0] = -1.0f;
  CHECK(d[6] == -1.0f);
  /* A view of a view; the last element of the base is in bounds. */
  const int64_t one[1] = {1};
  CHECK_OK(lz_tensor_view(&vv, v, 11, 1, one));
  CHECK(vv->data == d + 17);
  lz_tensor *last = NULL;
  CHECK_OK(lz_tensor_view(&last, base, 23, 1, one));
  CHECK(*(float *)last->data == 23.0f);
  lz_tensor_free(last);

  const int64_t six[1] = {6}, s0[1] = {0};
  CHECK_ERR(lz_tensor_view(&bad, base, 20, 1, six), LZ_ERR_INVALID,
            "tensor_view: elements [20, 26) are outside the base f32[4,6] (24 elements)");
  CHECK(bad == NULL);
  CHECK_ERR(lz_tensor_view(&bad, base, -1, 1, one), LZ_ERR_INVALID,
            "tensor_view: elements [-1, 0)");
  CHECK_ERR(lz_tensor_view(&bad, v, 8, 1, six), LZ_ERR_INVALID, "outside the base f32[2,6]");
  CHECK_OK(lz_tensor_view(&bad, base, 24, 1, s0)); /* empty, at the end: fine */
  lz_tensor_free(bad);

  /* The storage lives until its last tensor goes, whichever order. */
  CHECK_OK(lz_tensor_free(base));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_PARAMS) - before, 4 * 6 * 4);
  CHECK(((float *)vv->data)[0] == 17.0f); /* still readable (ASan would object) */
  CHECK_OK(lz_tensor_free(v));
  CHECK_OK(lz_tensor_free(vv));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_PARAMS) - before, 0);
}

LZ_TEST(tensor_wrap_new_describe) {
  int32_t mem[6] = {1, 2, 3, 4, 5, 6};
  const int64_t s[2] = {2, 3};
  const int64_t before = lz_mem_total_current();
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_wrap(&t, mem, LZ_I32, 2, s));
  CHECK(t->data == mem && t->storage == NULL && t->device == LZ_CPU);
  CHECK_EQ_INT(lz_tensor_numel(t), 6);
  CHECK_EQ_INT(lz_tensor_bytes(t), 24);
  char buf[64];
  CHECK(strcmp(lz_tensor_describe(t, buf, sizeof buf), "i32[2,3]") == 0);
  CHECK_EQ_INT(lz_mem_total_current(), before); /* wrapped memory is not on the ledger */
  CHECK_OK(lz_tensor_free(t));                   /* and is not freed */
  CHECK(mem[5] == 6);

  lz_tensor *bad = NULL;
  const int64_t neg[2] = {2, -3}, five[5] = {1, 1, 1, 1, 1};
  CHECK_ERR(lz_tensor_new(&bad, LZ_F32, 2, neg, LZ_MEM_PARAMS), LZ_ERR_INVALID,
            "tensor_new: dimension 1 is -3");
  CHECK_ERR(lz_tensor_new(&bad, LZ_F32, 5, five, LZ_MEM_PARAMS), LZ_ERR_INVALID,
            "tensor_new: 5 dimensions; tensors have 0 to 4");
  CHECK_ERR(lz_tensor_wrap(&bad, mem, (lz_dtype)9, 2, s), LZ_ERR_INVALID,
            "tensor_wrap: dtype 9 is not one of");
  CHECK(bad == NULL);
  /* 0-d: one element. */
  CHECK_OK(lz_tensor_new(&bad, LZ_BF16, 0, NULL, LZ_MEM_PARAMS));
  CHECK_EQ_INT(lz_tensor_numel(bad), 1);
  CHECK(strcmp(lz_tensor_describe(bad, buf, sizeof buf), "bf16[]") == 0);
  lz_tensor_free(bad);
  CHECK_EQ_INT(lz_dtype_size(LZ_BF16), 2);
  CHECK(strcmp(lz_dtype_name(LZ_U16), "u16") == 0);
}
