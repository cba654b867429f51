/* quant8.c — bitsandbytes' block-wise 8-bit code as its CPU library
 * (0.50.2) computes it. A value x of a block is stored as the index of a
 * map entry near x / absmax. bitsandbytes' quantiser finds that index with
 * a bucketed search (BinSearch's Direct2) whose buckets are computed in fp32,
 * then moves to the right neighbour when strictly nearer; the result is not
 * always the nearest entry (0.0 gets the signed map's entry 131, not its
 * 0.0, and the unsigned map's 7). As a function of z = x / absmax it is a
 * non-decreasing step function: the runs below are its steps, measured on
 * every fp32 in [-1, 1] through the library's own entry point
 * (cquantize_blockwise_cpu_fp32); NaN (0 / 0, inf / inf) gets index 0.
 * tests/ref/test5_adam8bit.py compares the indices with bitsandbytes' on
 * every step of its runs.
 *
 * The lookup: the magnitude's fp32 bits, clamped to [2^-26, 1] (no step lies
 * below 2^-25), cut by their top bits into cells of 2^16 consecutive floats,
 * one table per sign. No cell holds more than one step, so a cell's entry is
 * the index below its step, the index at and above it, and where the step
 * is (the low 16 bits of the magnitude): one load and one compare per value,
 * which vectorises as one gather. With AVX-512 VBMI2 a coarser form of the
 * same cells, small enough for byte permutes, replaces the gather
 * (lz_q8_fast, built from these cells). */
#include "optim/lz_quant8.h"

#include <pthread.h> /* pthread_once: the cell tables are built on first use */
#include <string.h>  /* memcpy */

/* bitsandbytes' create_dynamic_map(signed=True) and (signed=False): the
 * values it builds in fp32, sorted. */
static const float signed_values[256] = {
    -0x1.fc6666p-1f,  -0x1.f53334p-1f,  -0x1.eep-1f,      -0x1.e6ccccp-1f,  -0x1.df999ap-1f,
    -0x1.d86666p-1f,  -0x1.d13334p-1f,  -0x1.cap-1f,      -0x1.c2ccccp-1f,  -0x1.bb999ap-1f,
    -0x1.b46666p-1f,  -0x1.ad3334p-1f,  -0x1.a6p-1f,      -0x1.9eccccp-1f,  -0x1.97999ap-1f,
    -0x1.906666p-1f,  -0x1.893334p-1f,  -0x1.82p-1f,      -0x1.7accccp-1f,  -0x1.73999ap-1f,
    -0x1.6c6668p-1f,  -0x1.653334p-1f,  -0x1.5ep-1f,      -0x1.56ccccp-1f,  -0x1.4f999ap-1f,
    -0x1.486668p-1f,  -0x1.413334p-1f,  -0x1.3ap-1f,      -0x1.32ccccp-1f,  -0x1.2b999ap-1f,
    -0x1.246668p-1f,  -0x1.1d3334p-1f,  -0x1.16p-1f,      -0x1.0eccccp-1f,  -0x1.079998p-1f,
    -0x1.006666p-1f,  -0x1.f26664p-2f,  -0x1.e4p-2f,      -0x1.d59998p-2f,  -0x1.c73334p-2f,
    -0x1.b8ccccp-2f,  -0x1.aa6666p-2f,  -0x1.9cp-2f,      -0x1.8d9998p-2f,  -0x1.7f3334p-2f,
    -0x1.70ccccp-2f,  -0x1.626666p-2f,  -0x1.54p-2f,      -0x1.459998p-2f,  -0x1.373334p-2f,
    -0x1.28ccccp-2f,  -0x1.1a6668p-2f,  -0x1.0cp-2f,      -0x1.fb3332p-3f,  -0x1.de6666p-3f,
    -0x1.c1999ap-3f,  -0x1.a4ccccp-3f,  -0x1.88p-3f,      -0x1.6b3334p-3f,  -0x1.4e6666p-3f,
    -0x1.31999ap-3f,  -0x1.14ccccp-3f,  -0x1.fp-4f,       -0x1.b66668p-4f,  -0x1.93d70ap-4f,
    -0x1.8851eep-4f,  -0x1.7ccccep-4f,  -0x1.7147aep-4f,  -0x1.65c29p-4f,   -0x1.5a3d7p-4f,
    -0x1.4eb854p-4f,  -0x1.433334p-4f,  -0x1.37ae14p-4f,  -0x1.2c28f6p-4f,  -0x1.20a3d6p-4f,
    -0x1.151ebap-4f,  -0x1.09999ap-4f,  -0x1.fc28f6p-5f,  -0x1.e51ebap-5f,  -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f,  -0x1.ap-5f,       -0x1.88f5c2p-5f,  -0x1.71eb86p-5f,  -0x1.5ae146p-5f,
    -0x1.43d70ap-5f,  -0x1.2ccccep-5f,  -0x1.15c29p-5f,   -0x1.fd70a4p-6f,  -0x1.cf5c2ap-6f,
    -0x1.a147aep-6f,  -0x1.733334p-6f,  -0x1.451ebap-6f,  -0x1.170a3ep-6f,  -0x1.d1eb86p-7f,
    -0x1.75c29p-7f,   -0x1.3e76c8p-7f,  -0x1.2c083p-7f,   -0x1.19999ap-7f,  -0x1.072b02p-7f,
    -0x1.e978d4p-8f,  -0x1.c49ba6p-8f,  -0x1.9fbe76p-8f,  -0x1.7ae148p-8f,  -0x1.56041ap-8f,
    -0x1.3126e8p-8f,  -0x1.0c49bap-8f,  -0x1.ced914p-9f,  -0x1.851eb8p-9f,  -0x1.3b645ap-9f,
    -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f,
    -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f,
    -0x1.b43528p-19f, -0x1.27476ep-21f, 0x0p+0f,          0x1.27476ep-21f,  0x1.b43528p-19f,
    0x1.040bfep-17f,  0x1.64840cp-16f,  0x1.6f0068p-15f,  0x1.15df66p-14f,  0x1.743e96p-14f,
    0x1.47ae16p-13f,  0x1.19ce0ap-12f,  0x1.8fc506p-12f,  0x1.02de02p-11f,  0x1.3dd982p-11f,
    0x1.78d5p-11f,    0x1.b3d07cp-11f,  0x1.eecbfep-11f,  0x1.4fdf3ap-10f,  0x1.e353f8p-10f,
    0x1.3b645ap-9f,   0x1.851eb8p-9f,   0x1.ced914p-9f,   0x1.0c49bap-8f,   0x1.3126e8p-8f,
    0x1.56041ap-8f,   0x1.7ae148p-8f,   0x1.9fbe76p-8f,   0x1.c49ba6p-8f,   0x1.e978d4p-8f,
    0x1.072b02p-7f,   0x1.19999ap-7f,   0x1.2c083p-7f,    0x1.3e76c8p-7f,   0x1.75c29p-7f,
    0x1.d1eb86p-7f,   0x1.170a3ep-6f,   0x1.451ebap-6f,   0x1.733334p-6f,   0x1.a147aep-6f,
    0x1.cf5c2ap-6f,   0x1.fd70a4p-6f,   0x1.15c29p-5f,    0x1.2ccccep-5f,   0x1.43d70ap-5f,
    0x1.5ae146p-5f,   0x1.71eb86p-5f,   0x1.88f5c2p-5f,   0x1.ap-5f,        0x1.b70a3ep-5f,
    0x1.ce147ap-5f,   0x1.e51ebap-5f,   0x1.fc28f6p-5f,   0x1.09999ap-4f,   0x1.151ebap-4f,
    0x1.20a3d6p-4f,   0x1.2c28f6p-4f,   0x1.37ae14p-4f,   0x1.433334p-4f,   0x1.4eb854p-4f,
    0x1.5a3d7p-4f,    0x1.65c29p-4f,    0x1.7147aep-4f,   0x1.7ccccep-4f,   0x1.8851eep-4f,
    0x1.93d70ap-4f,   0x1.b66668p-4f,   0x1.fp-4f,        0x1.14ccccp-3f,   0x1.31999ap-3f,
    0x1.4e6666p-3f,   0x1.6b3334p-3f,   0x1.88p-3f,       0x1.a4ccccp-3f,   0x1.c1999ap-3f,
    0x1.de6666p-3f,   0x1.fb3332p-3f,   0x1.0cp-2f,       0x1.1a6668p-2f,   0x1.28ccccp-2f,
    0x1.373334p-2f,   0x1.459998p-2f,   0x1.54p-2f,       0x1.626666p-2f,   0x1.70ccccp-2f,
    0x1.7f3334p-2f,   0x1.8d9998p-2f,   0x1.9cp-2f,       0x1.aa6666p-2f,   0x1.b8ccccp-2f,
    0x1.c73334p-2f,   0x1.d59998p-2f,   0x1.e4p-2f,       0x1.f26664p-2f,   0x1.006666p-1f,
    0x1.079998p-1f,   0x1.0eccccp-1f,   0x1.16p-1f,       0x1.1d3334p-1f,   0x1.246668p-1f,
    0x1.2b999ap-1f,   0x1.32ccccp-1f,   0x1.3ap-1f,       0x1.413334p-1f,   0x1.486668p-1f,
    0x1.4f999ap-1f,   0x1.56ccccp-1f,   0x1.5ep-1f,       0x1.653334p-1f,   0x1.6c6668p-1f,
    0x1.73999ap-1f,   0x1.7accccp-1f,   0x1.82p-1f,       0x1.893334p-1f,   0x1.906666p-1f,
    0x1.97999ap-1f,   0x1.9eccccp-1f,   0x1.a6p-1f,       0x1.ad3334p-1f,   0x1.b46666p-1f,
    0x1.bb999ap-1f,   0x1.c2ccccp-1f,   0x1.cap-1f,       0x1.d13334p-1f,   0x1.d86666p-1f,
    0x1.df999ap-1f,   0x1.e6ccccp-1f,   0x1.eep-1f,       0x1.f53334p-1f,   0x1.fc6666p-1f,
    0x1p+0f,
};
static const float unsigned_values[256] = {
    0x0p+0f,         0x1.5cf754p-22f, 0x1.a0133p-21f,  0x1.1d367p-19f,  0x1.2599ecp-18f,
    0x1.bc98a2p-18f, 0x1.29cbaap-17f, 0x1.0624dcp-16f, 0x1.c2e34p-16f,  0x1.3fd0dp-15f,
    0x1.9e3p-15f,    0x1.fc8f34p-15f, 0x1.2d7732p-14f, 0x1.5ca6c8p-14f, 0x1.8bd662p-14f,
    0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a092p-13f, 0x1.374bc8p-12f, 0x1.724744p-12f,
    0x1.ad42c6p-12f, 0x1.e83e44p-12f, 0x1.119ce2p-11f, 0x1.2f1aap-11f,  0x1.4c986p-11f,
    0x1.6a162p-11f,  0x1.8793dep-11f, 0x1.a511ap-11f,  0x1.c28f5ep-11f, 0x1.e00d1cp-11f,
    0x1.fd8adcp-11f, 0x1.2b020cp-10f, 0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f,
    0x1.28f5c2p-9f,  0x1.4dd2fp-9f,   0x1.72b02p-9f,   0x1.978d4ep-9f,  0x1.bc6a8p-9f,
    0x1.e147aep-9f,  0x1.03126ep-8f,  0x1.158104p-8f,  0x1.27ef9ep-8f,  0x1.3a5e34p-8f,
    0x1.4cccccp-8f,  0x1.5f3b64p-8f,  0x1.71a9fap-8f,  0x1.841894p-8f,  0x1.96872ap-8f,
    0x1.a8f5c2p-8f,  0x1.bb645cp-8f,  0x1.cdd2fp-8f,   0x1.e0418ap-8f,  0x1.f2b01ep-8f,
    0x1.028f5cp-7f,  0x1.0bc6a8p-7f,  0x1.14fdf2p-7f,  0x1.1e354p-7f,   0x1.276c8ap-7f,
    0x1.30a3d6p-7f,  0x1.39db24p-7f,  0x1.43126ep-7f,  0x1.5eb854p-7f,  0x1.8ccccep-7f,
    0x1.bae146p-7f,  0x1.e8f5c4p-7f,  0x1.0b851ep-6f,  0x1.228f5ep-6f,  0x1.39999ap-6f,
    0x1.50a3d6p-6f,  0x1.67ae16p-6f,  0x1.7eb852p-6f,  0x1.95c28ep-6f,  0x1.accccep-6f,
    0x1.c3d70ep-6f,  0x1.dae146p-6f,  0x1.f1eb86p-6f,  0x1.047aep-5f,   0x1.1p-5f,
    0x1.1b851ep-5f,  0x1.270a3ep-5f,  0x1.328f5ep-5f,  0x1.3e147ap-5f,  0x1.49999ap-5f,
    0x1.551eb8p-5f,  0x1.60a3d6p-5f,  0x1.6c28f6p-5f,  0x1.77ae14p-5f,  0x1.833334p-5f,
    0x1.8eb85p-5f,   0x1.9a3d7p-5f,   0x1.a5c28ep-5f,  0x1.b147aep-5f,  0x1.bccccep-5f,
    0x1.c851eep-5f,  0x1.d3d70ep-5f,  0x1.df5c2ap-5f,  0x1.eae146p-5f,  0x1.f66666p-5f,
    0x1.00f5c4p-4f,  0x1.06b854p-4f,  0x1.0c7ae2p-4f,  0x1.123d7p-4f,   0x1.18p-4f,
    0x1.1dc29p-4f,   0x1.23852p-4f,   0x1.2947aep-4f,  0x1.2f0a3ep-4f,  0x1.34cccep-4f,
    0x1.3a8f5ep-4f,  0x1.4051ecp-4f,  0x1.46147cp-4f,  0x1.4bd70ap-4f,  0x1.51999ap-4f,
    0x1.575c2ap-4f,  0x1.5d1eb8p-4f,  0x1.62e148p-4f,  0x1.68a3d6p-4f,  0x1.6e6666p-4f,
    0x1.7428f6p-4f,  0x1.79eb86p-4f,  0x1.7fae16p-4f,  0x1.8570a4p-4f,  0x1.8b3334p-4f,
    0x1.90f5c4p-4f,  0x1.96b852p-4f,  0x1.a8p-4f,      0x1.c4ccccp-4f,  0x1.e1999ap-4f,
    0x1.fe6666p-4f,  0x1.0d9998p-3f,  0x1.1cp-3f,      0x1.2a6668p-3f,  0x1.38ccccp-3f,
    0x1.473334p-3f,  0x1.559998p-3f,  0x1.64p-3f,      0x1.726668p-3f,  0x1.80ccccp-3f,
    0x1.8f3334p-3f,  0x1.9d9998p-3f,  0x1.acp-3f,      0x1.ba6668p-3f,  0x1.c8ccccp-3f,
    0x1.d73334p-3f,  0x1.e59998p-3f,  0x1.f4p-3f,      0x1.013332p-2f,  0x1.086666p-2f,
    0x1.0f999ap-2f,  0x1.16ccccp-2f,  0x1.1ep-2f,      0x1.253334p-2f,  0x1.2c6666p-2f,
    0x1.339998p-2f,  0x1.3accccp-2f,  0x1.42p-2f,      0x1.493334p-2f,  0x1.506666p-2f,
    0x1.579998p-2f,  0x1.5eccccp-2f,  0x1.66p-2f,      0x1.6d3334p-2f,  0x1.746666p-2f,
    0x1.7b9998p-2f,  0x1.82ccccp-2f,  0x1.8ap-2f,      0x1.913334p-2f,  0x1.986666p-2f,
    0x1.9f9998p-2f,  0x1.a6ccccp-2f,  0x1.aep-2f,      0x1.b53334p-2f,  0x1.bc6666p-2f,
    0x1.c39998p-2f,  0x1.caccccp-2f,  0x1.d2p-2f,      0x1.d93334p-2f,  0x1.e06666p-2f,
    0x1.e79998p-2f,  0x1.eeccccp-2f,  0x1.f6p-2f,      0x1.fd3332p-2f,  0x1.023334p-1f,
    0x1.05ccccp-1f,  0x1.096666p-1f,  0x1.0dp-1f,      0x1.109998p-1f,  0x1.143334p-1f,
    0x1.17ccccp-1f,  0x1.1b6668p-1f,  0x1.1fp-1f,      0x1.22999ap-1f,  0x1.263334p-1f,
    0x1.29ccccp-1f,  0x1.2d6668p-1f,  0x1.31p-1f,      0x1.34999ap-1f,  0x1.383334p-1f,
    0x1.3bccccp-1f,  0x1.3f6668p-1f,  0x1.43p-1f,      0x1.46999ap-1f,  0x1.4a3334p-1f,
    0x1.4dccccp-1f,  0x1.516668p-1f,  0x1.55p-1f,      0x1.58999ap-1f,  0x1.5c3334p-1f,
    0x1.5fccccp-1f,  0x1.636668p-1f,  0x1.67p-1f,      0x1.6a999ap-1f,  0x1.6e3334p-1f,
    0x1.71ccccp-1f,  0x1.756668p-1f,  0x1.79p-1f,      0x1.7c999ap-1f,  0x1.803334p-1f,
    0x1.83ccccp-1f,  0x1.876668p-1f,  0x1.8bp-1f,      0x1.8e9998p-1f,  0x1.923334p-1f,
    0x1.95ccccp-1f,  0x1.996668p-1f,  0x1.9dp-1f,      0x1.a09998p-1f,  0x1.a43334p-1f,
    0x1.a7ccccp-1f,  0x1.ab6668p-1f,  0x1.afp-1f,      0x1.b29998p-1f,  0x1.b63334p-1f,
    0x1.b9ccccp-1f,  0x1.bd6668p-1f,  0x1.c1p-1f,      0x1.c49998p-1f,  0x1.c83334p-1f,
    0x1.cbccccp-1f,  0x1.cf6668p-1f,  0x1.d3p-1f,      0x1.d69998p-1f,  0x1.da3334p-1f,
    0x1.ddccccp-1f,  0x1.e16668p-1f,  0x1.e5p-1f,      0x1.e89998p-1f,  0x1.ec3334p-1f,
    0x1.efccccp-1f,  0x1.f36668p-1f,  0x1.f7p-1f,      0x1.fa9998p-1f,  0x1.fe3334p-1f,
    0x1p+0f,
};

/* One step of the quantiser: from z = `from` up, the index is `index`. */
typedef struct {
  float from;
  uint8_t index;
} lz_q8_run;

/* signed: the first value of each run after the one starting at -1 (index 0) */
static const lz_q8_run signed_runs[248] = {
    {-0x1.f8cdf8p-1f, 1},   {-0x1.f199fp-1f, 2},    {-0x1.ea65eap-1f, 3},   {-0x1.e331e2p-1f, 4},
    {-0x1.dc01dcp-1f, 5},   {-0x1.d4cdd4p-1f, 6},   {-0x1.cd99ccp-1f, 7},   {-0x1.c665c6p-1f, 8},
    {-0x1.bf31bep-1f, 9},   {-0x1.b801b8p-1f, 10},  {-0x1.b0cdbp-1f, 11},   {-0x1.a999a8p-1f, 12},
    {-0x1.a265a2p-1f, 13},  {-0x1.9b319ap-1f, 14},  {-0x1.940194p-1f, 15},  {-0x1.8ccd8cp-1f, 16},
    {-0x1.859984p-1f, 17},  {-0x1.7e657ep-1f, 18},  {-0x1.773176p-1f, 19},  {-0x1.70017p-1f, 20},
    {-0x1.68cd68p-1f, 21},  {-0x1.619962p-1f, 22},  {-0x1.5a655ap-1f, 23},  {-0x1.533152p-1f, 24},
    {-0x1.4c014cp-1f, 25},  {-0x1.44cd44p-1f, 26},  {-0x1.3d993ep-1f, 27},  {-0x1.366536p-1f, 28},
    {-0x1.2f352ep-1f, 29},  {-0x1.280128p-1f, 30},  {-0x1.20cd2p-1f, 31},   {-0x1.19991ap-1f, 32},
    {-0x1.126512p-1f, 33},  {-0x1.0b350ap-1f, 34},  {-0x1.040104p-1f, 35},  {-0x1.f999fap-2f, 36},
    {-0x1.eb31ecp-2f, 37},  {-0x1.dcc9dcp-2f, 38},  {-0x1.ce69d2p-2f, 39},  {-0x1.c001c2p-2f, 40},
    {-0x1.b199b2p-2f, 41},  {-0x1.a331a4p-2f, 42},  {-0x1.94c994p-2f, 43},  {-0x1.86698ap-2f, 44},
    {-0x1.78017ap-2f, 45},  {-0x1.69996ap-2f, 46},  {-0x1.5b315cp-2f, 47},  {-0x1.4cc94cp-2f, 48},
    {-0x1.3e6942p-2f, 49},  {-0x1.300132p-2f, 50},  {-0x1.219922p-2f, 51},  {-0x1.133114p-2f, 52},
    {-0x1.04c904p-2f, 53},  {-0x1.ecd1f4p-3f, 54},  {-0x1.d001d4p-3f, 55},  {-0x1.b331b4p-3f, 56},
    {-0x1.96619ap-3f, 57},  {-0x1.79a17ap-3f, 58},  {-0x1.5cd164p-3f, 59},  {-0x1.400144p-3f, 60},
    {-0x1.233124p-3f, 61},  {-0x1.06610ap-3f, 62},  {-0x1.d341d6p-4f, 63},  {-0x1.a521a8p-4f, 64},
    {-0x1.8e2196p-4f, 65},  {-0x1.828188p-4f, 66},  {-0x1.770176p-4f, 67},  {-0x1.6b8176p-4f, 68},
    {-0x1.600168p-4f, 69},  {-0x1.548156p-4f, 70},  {-0x1.490156p-4f, 71},  {-0x1.3d6148p-4f, 72},
    {-0x1.31e136p-4f, 73},  {-0x1.266128p-4f, 74},  {-0x1.1ae128p-4f, 75},  {-0x1.0f6116p-4f, 76},
    {-0x1.03e108p-4f, 77},  {-0x1.f0c21p-5f, 78},   {-0x1.d981eep-5f, 79},  {-0x1.c281dp-5f, 80},
    {-0x1.ab81aep-5f, 81},  {-0x1.9481aep-5f, 82},  {-0x1.7d819p-5f, 83},   {-0x1.66816ep-5f, 84},
    {-0x1.4f415p-5f, 85},   {-0x1.38415p-5f, 86},   {-0x1.21412ep-5f, 87},  {-0x1.0a411p-5f, 88},
    {-0x1.e6822p-6f, 89},   {-0x1.b881dep-6f, 90},  {-0x1.8a01ap-6f, 91},   {-0x1.5c015ep-6f, 92},
    {-0x1.2e015ep-6f, 93},  {-0x1.00012p-6f, 94},   {-0x1.a401bep-7f, 95},  {-0x1.5a01bep-7f, 96},
    {-0x1.35014p-7f, 97},   {-0x1.23014p-7f, 98},   {-0x1.10014p-7f, 99},   {-0x1.fc028p-8f, 100},
    {-0x1.d8028p-8f, 101},  {-0x1.b2028p-8f, 102},  {-0x1.8e028p-8f, 103},  {-0x1.68017ep-8f, 104},
    {-0x1.44017ep-8f, 105}, {-0x1.1e017ep-8f, 106}, {-0x1.f402fep-9f, 107}, {-0x1.a802fep-9f, 108},
    {-0x1.6002fep-9f, 109}, {-0x1.1802fep-9f, 110}, {-0x1.9802p-10f, 111},  {-0x1.2002p-10f, 112},
    {-0x1.d004p-11f, 113},  {-0x1.9004p-11f, 114},  {-0x1.6004p-11f, 115},  {-0x1.2004p-11f, 116},
    {-0x1.c008p-12f, 117},  {-0x1.6008p-12f, 118},  {-0x1.c01p-13f, 119},   {-0x1.001p-13f, 120},
    {-0x1.802p-14f, 121},   {-0x1.002p-14f, 122},   {-0x1.004p-15f, 123},   {-0x1p-25f, 131},
    {0x1.ffp-16f, 132},     {0x1.ff8p-15f, 133},    {0x1.7fcp-14f, 134},    {0x1.ffcp-14f, 135},
    {0x1.bfep-13f, 136},    {0x1.5ffp-12f, 137},    {0x1.bffp-12f, 138},    {0x1.1ff8p-11f, 139},
    {0x1.5ff8p-11f, 140},   {0x1.8ff8p-11f, 141},   {0x1.cff8p-11f, 142},   {0x1.1ffcp-10f, 143},
    {0x1.97fcp-10f, 144},   {0x1.17fep-9f, 145},    {0x1.5ffep-9f, 146},    {0x1.a7fep-9f, 147},
    {0x1.f3fep-9f, 148},    {0x1.1e0102p-8f, 149},  {0x1.440102p-8f, 150},  {0x1.680102p-8f, 151},
    {0x1.8e0102p-8f, 152},  {0x1.b20102p-8f, 153},  {0x1.d80102p-8f, 154},  {0x1.fc0102p-8f, 155},
    {0x1.100082p-7f, 156},  {0x1.230082p-7f, 157},  {0x1.350082p-7f, 158},  {0x1.5a0082p-7f, 159},
    {0x1.a4018p-7f, 160},   {0x1.0000cp-6f, 161},   {0x1.2e00cp-6f, 162},   {0x1.5c0142p-6f, 163},
    {0x1.8a0142p-6f, 164},  {0x1.b88142p-6f, 165},  {0x1.e681cp-6f, 166},   {0x1.0a40ep-5f, 167},
    {0x1.214122p-5f, 168},  {0x1.384122p-5f, 169},  {0x1.4f4122p-5f, 170},  {0x1.66816p-5f, 171},
    {0x1.7d816p-5f, 172},   {0x1.94816p-5f, 173},   {0x1.ab81a2p-5f, 174},  {0x1.c281a2p-5f, 175},
    {0x1.d981a2p-5f, 176},  {0x1.f0c1ep-5f, 177},   {0x1.03e0fp-4f, 178},   {0x1.0f60fp-4f, 179},
    {0x1.1ae112p-4f, 180},  {0x1.266112p-4f, 181},  {0x1.31e13p-4f, 182},   {0x1.3d613p-4f, 183},
    {0x1.49013p-4f, 184},   {0x1.548152p-4f, 185},  {0x1.600152p-4f, 186},  {0x1.6b8152p-4f, 187},
    {0x1.77017p-4f, 188},   {0x1.82817p-4f, 189},   {0x1.8e217p-4f, 190},   {0x1.a52192p-4f, 191},
    {0x1.d341d2p-4f, 192},  {0x1.0660f8p-3f, 193},  {0x1.233118p-3f, 194},  {0x1.400138p-3f, 195},
    {0x1.5cd158p-3f, 196},  {0x1.79a178p-3f, 197},  {0x1.96618ap-3f, 198},  {0x1.b331aap-3f, 199},
    {0x1.d001cap-3f, 200},  {0x1.ecd1eap-3f, 201},  {0x1.04c906p-2f, 202},  {0x1.13310cp-2f, 203},
    {0x1.21991cp-2f, 204},  {0x1.30012cp-2f, 205},  {0x1.3e693cp-2f, 206},  {0x1.4cc94cp-2f, 207},
    {0x1.5b3156p-2f, 208},  {0x1.699966p-2f, 209},  {0x1.780176p-2f, 210},  {0x1.866986p-2f, 211},
    {0x1.94c996p-2f, 212},  {0x1.a3319cp-2f, 213},  {0x1.b199acp-2f, 214},  {0x1.c001bcp-2f, 215},
    {0x1.ce69ccp-2f, 216},  {0x1.dcc9dcp-2f, 217},  {0x1.eb31e6p-2f, 218},  {0x1.f999f6p-2f, 219},
    {0x1.040104p-1f, 220},  {0x1.0b350cp-1f, 221},  {0x1.126514p-1f, 222},  {0x1.199916p-1f, 223},
    {0x1.20cd1ep-1f, 224},  {0x1.280126p-1f, 225},  {0x1.2f352ep-1f, 226},  {0x1.366536p-1f, 227},
    {0x1.3d993cp-1f, 228},  {0x1.44cd44p-1f, 229},  {0x1.4c014cp-1f, 230},  {0x1.533154p-1f, 231},
    {0x1.5a655cp-1f, 232},  {0x1.61995ep-1f, 233},  {0x1.68cd66p-1f, 234},  {0x1.70016ep-1f, 235},
    {0x1.773176p-1f, 236},  {0x1.7e657ep-1f, 237},  {0x1.859984p-1f, 238},  {0x1.8ccd8cp-1f, 239},
    {0x1.940194p-1f, 240},  {0x1.9b319cp-1f, 241},  {0x1.a265a4p-1f, 242},  {0x1.a999a6p-1f, 243},
    {0x1.b0cdaep-1f, 244},  {0x1.b801b6p-1f, 245},  {0x1.bf31bep-1f, 246},  {0x1.c665c6p-1f, 247},
    {0x1.cd99ccp-1f, 248},  {0x1.d4cdd4p-1f, 249},  {0x1.dc01dcp-1f, 250},  {0x1.e331e4p-1f, 251},
    {0x1.ea65ecp-1f, 252},  {0x1.f199eep-1f, 253},  {0x1.f8cdf6p-1f, 254},  {0x1.fe31fep-1f, 255},
};
/* unsigned: the first value of each run after the one starting at -1 (index 0) */
static const lz_q8_run unsigned_runs[245] = {
    {-0x1p-25f, 7},        {0x1.ffp-16f, 10},     {0x1.ff8p-15f, 12},    {0x1.7fcp-14f, 14},
    {0x1.ffcp-14f, 15},    {0x1.3fep-13f, 16},    {0x1.bfep-13f, 17},    {0x1.1ffp-12f, 18},
    {0x1.5ffp-12f, 19},    {0x1.7ffp-12f, 20},    {0x1.bffp-12f, 21},    {0x1.fffp-12f, 22},
    {0x1.1ff8p-11f, 23},   {0x1.3ff8p-11f, 24},   {0x1.5ff8p-11f, 25},   {0x1.7ff8p-11f, 26},
    {0x1.8ff8p-11f, 27},   {0x1.aff8p-11f, 28},   {0x1.cff8p-11f, 29},   {0x1.eff8p-11f, 30},
    {0x1.17fcp-10f, 31},   {0x1.4ffcp-10f, 32},   {0x1.97fcp-10f, 33},   {0x1.dffcp-10f, 34},
    {0x1.17fep-9f, 35},    {0x1.3bfep-9f, 36},    {0x1.5ffep-9f, 37},    {0x1.83fep-9f, 38},
    {0x1.a7fep-9f, 39},    {0x1.cffep-9f, 40},    {0x1.f3fep-9f, 41},    {0x1.0c0102p-8f, 42},
    {0x1.1e0102p-8f, 43},  {0x1.320102p-8f, 44},  {0x1.440102p-8f, 45},  {0x1.560102p-8f, 46},
    {0x1.680102p-8f, 47},  {0x1.7a0102p-8f, 48},  {0x1.8e0102p-8f, 49},  {0x1.a00102p-8f, 50},
    {0x1.b20102p-8f, 51},  {0x1.c40102p-8f, 52},  {0x1.d80102p-8f, 53},  {0x1.ea0102p-8f, 54},
    {0x1.fc0102p-8f, 55},  {0x1.070082p-7f, 56},  {0x1.100082p-7f, 57},  {0x1.1a0082p-7f, 58},
    {0x1.230082p-7f, 59},  {0x1.2c0082p-7f, 60},  {0x1.350082p-7f, 61},  {0x1.3e0082p-7f, 62},
    {0x1.510082p-7f, 63},  {0x1.760082p-7f, 64},  {0x1.a4018p-7f, 65},   {0x1.d2018p-7f, 66},
    {0x1.0000cp-6f, 67},   {0x1.1700cp-6f, 68},   {0x1.2e00cp-6f, 69},   {0x1.450142p-6f, 70},
    {0x1.5c0142p-6f, 71},  {0x1.730142p-6f, 72},  {0x1.8a0142p-6f, 73},  {0x1.a18142p-6f, 74},
    {0x1.b88142p-6f, 75},  {0x1.cf81cp-6f, 76},   {0x1.e681cp-6f, 77},   {0x1.fd81cp-6f, 78},
    {0x1.0a40ep-5f, 79},   {0x1.15c0ep-5f, 80},   {0x1.214122p-5f, 81},  {0x1.2cc122p-5f, 82},
    {0x1.384122p-5f, 83},  {0x1.43c122p-5f, 84},  {0x1.4f4122p-5f, 85},  {0x1.5b0122p-5f, 86},
    {0x1.66816p-5f, 87},   {0x1.72016p-5f, 88},   {0x1.7d816p-5f, 89},   {0x1.89016p-5f, 90},
    {0x1.94816p-5f, 91},   {0x1.a001a2p-5f, 92},  {0x1.ab81a2p-5f, 93},  {0x1.b701a2p-5f, 94},
    {0x1.c281a2p-5f, 95},  {0x1.ce01a2p-5f, 96},  {0x1.d981a2p-5f, 97},  {0x1.e501ep-5f, 98},
    {0x1.f0c1ep-5f, 99},   {0x1.fc41ep-5f, 100},  {0x1.03e0fp-4f, 101},  {0x1.09a0fp-4f, 102},
    {0x1.0f60fp-4f, 103},  {0x1.152112p-4f, 104}, {0x1.1ae112p-4f, 105}, {0x1.20a112p-4f, 106},
    {0x1.266112p-4f, 107}, {0x1.2c2112p-4f, 108}, {0x1.31e13p-4f, 109},  {0x1.37a13p-4f, 110},
    {0x1.3d613p-4f, 111},  {0x1.43413p-4f, 112},  {0x1.49013p-4f, 113},  {0x1.4ec13p-4f, 114},
    {0x1.548152p-4f, 115}, {0x1.5a4152p-4f, 116}, {0x1.600152p-4f, 117}, {0x1.65c152p-4f, 118},
    {0x1.6b8152p-4f, 119}, {0x1.71417p-4f, 120},  {0x1.77017p-4f, 121},  {0x1.7cc17p-4f, 122},
    {0x1.82817p-4f, 123},  {0x1.88617p-4f, 124},  {0x1.8e217p-4f, 125},  {0x1.93e192p-4f, 126},
    {0x1.9f6192p-4f, 127}, {0x1.b661bp-4f, 128},  {0x1.d341d2p-4f, 129}, {0x1.f001fp-4f, 130},
    {0x1.0660f8p-3f, 131}, {0x1.14d10ap-3f, 132}, {0x1.233118p-3f, 133}, {0x1.31a12ap-3f, 134},
    {0x1.400138p-3f, 135}, {0x1.4e614ap-3f, 136}, {0x1.5cd158p-3f, 137}, {0x1.6b316ap-3f, 138},
    {0x1.79a178p-3f, 139}, {0x1.88018ap-3f, 140}, {0x1.96618ap-3f, 141}, {0x1.a4d198p-3f, 142},
    {0x1.b331aap-3f, 143}, {0x1.c191b8p-3f, 144}, {0x1.d001cap-3f, 145}, {0x1.de61d8p-3f, 146},
    {0x1.ecd1eap-3f, 147}, {0x1.fb31f8p-3f, 148}, {0x1.04c906p-2f, 149}, {0x1.0c010cp-2f, 150},
    {0x1.13310cp-2f, 151}, {0x1.1a6916p-2f, 152}, {0x1.21991cp-2f, 153}, {0x1.28c926p-2f, 154},
    {0x1.30012cp-2f, 155}, {0x1.373136p-2f, 156}, {0x1.3e693cp-2f, 157}, {0x1.459946p-2f, 158},
    {0x1.4cc94cp-2f, 159}, {0x1.540156p-2f, 160}, {0x1.5b3156p-2f, 161}, {0x1.62695cp-2f, 162},
    {0x1.699966p-2f, 163}, {0x1.70c96cp-2f, 164}, {0x1.780176p-2f, 165}, {0x1.7f317cp-2f, 166},
    {0x1.866986p-2f, 167}, {0x1.8d998cp-2f, 168}, {0x1.94c996p-2f, 169}, {0x1.9c019cp-2f, 170},
    {0x1.a3319cp-2f, 171}, {0x1.aa69a6p-2f, 172}, {0x1.b199acp-2f, 173}, {0x1.b8c9b6p-2f, 174},
    {0x1.c001bcp-2f, 175}, {0x1.c731c6p-2f, 176}, {0x1.ce69ccp-2f, 177}, {0x1.d599d6p-2f, 178},
    {0x1.dcc9dcp-2f, 179}, {0x1.e401e6p-2f, 180}, {0x1.eb31e6p-2f, 181}, {0x1.f269ecp-2f, 182},
    {0x1.f999f6p-2f, 183}, {0x1.0064fep-1f, 184}, {0x1.040104p-1f, 185}, {0x1.079906p-1f, 186},
    {0x1.0b350cp-1f, 187}, {0x1.0ecd0ep-1f, 188}, {0x1.126514p-1f, 189}, {0x1.160116p-1f, 190},
    {0x1.199916p-1f, 191}, {0x1.1d351cp-1f, 192}, {0x1.20cd1ep-1f, 193}, {0x1.246524p-1f, 194},
    {0x1.280126p-1f, 195}, {0x1.2b992cp-1f, 196}, {0x1.2f352ep-1f, 197}, {0x1.32cd34p-1f, 198},
    {0x1.366536p-1f, 199}, {0x1.3a013cp-1f, 200}, {0x1.3d993cp-1f, 201}, {0x1.41313ep-1f, 202},
    {0x1.44cd44p-1f, 203}, {0x1.486546p-1f, 204}, {0x1.4c014cp-1f, 205}, {0x1.4f994ep-1f, 206},
    {0x1.533154p-1f, 207}, {0x1.56cd56p-1f, 208}, {0x1.5a655cp-1f, 209}, {0x1.5e015ep-1f, 210},
    {0x1.61995ep-1f, 211}, {0x1.653164p-1f, 212}, {0x1.68cd66p-1f, 213}, {0x1.6c656cp-1f, 214},
    {0x1.70016ep-1f, 215}, {0x1.739974p-1f, 216}, {0x1.773176p-1f, 217}, {0x1.7acd7cp-1f, 218},
    {0x1.7e657ep-1f, 219}, {0x1.820184p-1f, 220}, {0x1.859984p-1f, 221}, {0x1.893186p-1f, 222},
    {0x1.8ccd8cp-1f, 223}, {0x1.90658ep-1f, 224}, {0x1.940194p-1f, 225}, {0x1.979996p-1f, 226},
    {0x1.9b319cp-1f, 227}, {0x1.9ecd9ep-1f, 228}, {0x1.a265a4p-1f, 229}, {0x1.a601a6p-1f, 230},
    {0x1.a999a6p-1f, 231}, {0x1.ad31acp-1f, 232}, {0x1.b0cdaep-1f, 233}, {0x1.b465b4p-1f, 234},
    {0x1.b801b6p-1f, 235}, {0x1.bb99bcp-1f, 236}, {0x1.bf31bep-1f, 237}, {0x1.c2cdc4p-1f, 238},
    {0x1.c665c6p-1f, 239}, {0x1.ca01ccp-1f, 240}, {0x1.cd99ccp-1f, 241}, {0x1.d131cep-1f, 242},
    {0x1.d4cdd4p-1f, 243}, {0x1.d865d6p-1f, 244}, {0x1.dc01dcp-1f, 245}, {0x1.df99dep-1f, 246},
    {0x1.e331e4p-1f, 247}, {0x1.e6cde6p-1f, 248}, {0x1.ea65ecp-1f, 249}, {0x1.ee01eep-1f, 250},
    {0x1.f199eep-1f, 251}, {0x1.f531f4p-1f, 252}, {0x1.f8cdf6p-1f, 253}, {0x1.fc65fcp-1f, 254},
    {0x1.ff19fep-1f, 255},
};

/* The index the runs give z (the scalar truth the cells are built from). */
static uint8_t run_index(const lz_q8_run *runs, int n, float z) {
  int lo = 0, hi = n; /* count the runs starting at or below z */
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (runs[mid].from <= z)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo ? runs[lo - 1].index : 0;
}

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint32_t signed_cells[2 * Q8_SIDE], unsigned_cells[2 * Q8_SIDE];
static uint8_t signed_planes[4][256], unsigned_planes[4][256];
static lz_q8_fast signed_fast, unsigned_fast;
static lz_q8_map maps[2] = {{unsigned_values, unsigned_cells, unsigned_planes, NULL},
                            {signed_values, signed_cells, signed_planes, NULL}};

/* A cell's entry: bits 0-15 where the step is (the low bits of the first
 * magnitude at the upper index; 0 when the cell has one index), 16-23 the
 * index of the cell's smaller magnitudes, 24-31 that of its larger ones. */
static void build_cells(uint32_t *cells, const lz_q8_run *runs, int n) {
  for (uint32_t side = 0; side < 2; side++)
    for (uint32_t c = 0; c < Q8_SIDE; c++) {
      const uint32_t a0 = Q8_LO + (c << 16), a1 = a0 + 0xffff < Q8_ONE ? a0 + 0xffff : Q8_ONE;
      const uint32_t sign = side << 31;
      const uint8_t small = run_index(runs, n, from_bits(sign | a0));
      const uint8_t large = run_index(runs, n, from_bits(sign | a1));
      uint32_t lo = a0, hi = a1; /* the first magnitude with the larger's index */
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (run_index(runs, n, from_bits(sign | mid)) == large)
          hi = mid;
        else
          lo = mid + 1;
      }
      cells[side * Q8_SIDE + c] =
          (small == large ? 0 : lo - a0) | (uint32_t)small << 16 | (uint32_t)large << 24;
    }
}

static void build_planes(uint8_t planes[4][256], const float *values) {
  for (int i = 0; i < 256; i++) {
    uint32_t u;
    memcpy(&u, &values[i], sizeof u);
    for (int k = 0; k < 4; k++) planes[k][i] = (uint8_t)(u >> (8 * k));
  }
}

static inline __attribute__((always_inline)) uint8_t index_of(const uint32_t *cells, float z);

/* Where the cells of each binade go in the tables (cell = the magnitude's
 * top 16 bits >> shift, plus an offset, modulo 256, so a binade's cells are
 * consecutive modulo 256 and may start anywhere). The cell of 1.0 (the binade
 * [1, 2), where no other quotient lies) is placed at 0 for + and 1 for -:
 * NaN and inf, whose exponent is that binade's modulo 32 and whose top bits
 * are 128 cells further, land at 128 and 129, two cells of their own whose
 * label is that of index 0, so the lookup gives NaN its index without a
 * check. The other binades fill 2..127 and 130..255, largest first. Returns
 * 0 where they do not fit. */
static int place_binades(const int k[2][32], int pos[2][32]) {
  int room[2] = {126, 126}, next[2] = {2, 130};
  for (int size = 128; size >= 1; size /= 2)
    for (int side = 0; side < 2; side++)
      for (uint32_t ex = Q8_LO >> 23; ex < Q8_ONE >> 23; ex++) {
        if ((1 << k[side][ex & 31]) != size) continue;
        int bin = room[0] >= size ? 0 : 1;
        if (room[bin] < size) return 0;
        pos[side][ex & 31] = next[bin], next[bin] += size, room[bin] -= size;
      }
  return 1;
}

/* The fast tables from the cells (built first): 0 where the steps do not fit
 * them (more than 252 cells or 256 labels, or a step inside the cell that the
 * magnitudes below 2^-26 are clamped into, whose mantissa is not theirs). */
static int build_fast(lz_q8_fast *f, const uint32_t *cells) {
  enum { MAXS = 512, ONE_EX = Q8_ONE >> 23 };
  int n_labels = 0, k_of[2][32] = {{0}}, pos[2][32] = {{0}}, first[2], n_at[2];
  uint32_t at[2][MAXS]; /* the magnitudes where the index changes, from Q8_LO up */
  for (uint32_t side = 0; side < 2; side++) {
    const uint32_t sign = side << 31;
    int n = 0;
    uint8_t cur = index_of(cells, from_bits(sign | Q8_LO));
    first[side] = n_labels;
    if (n_labels >= 256) return 0;
    f->index[n_labels++] = cur;
    for (uint32_t c = 0; c < Q8_SIDE; c++) {
      const uint32_t a0 = Q8_LO + (c << 16), e = cells[side * Q8_SIDE + c];
      const uint8_t i0 = index_of(cells, from_bits(sign | a0));
      if (i0 != cur) {
        if (n >= MAXS || n_labels >= 256) return 0;
        at[side][n++] = a0, f->index[n_labels++] = cur = i0;
      }
      if ((e & 0xffff) && (uint8_t)(e >> 24) != cur) {
        if (n >= MAXS || n_labels >= 256) return 0;
        at[side][n++] = a0 + (e & 0xffff);
        f->index[n_labels++] = cur = (uint8_t)(e >> 24);
      }
    }
    n_at[side] = n;
    for (uint32_t ex = Q8_LO >> 23; ex <= ONE_EX; ex++) {
      const uint32_t lo = ex << 23, hi = lo + (1u << 23); /* the binade [lo, hi) */
      int k = 0;
      for (;; k++) { /* the fewest top mantissa bits with at most 2 steps inside a cell */
        if (k > 7) return 0;
        int ok = 1;
        for (int s = 2; s < n && ok; s++)
          if (at[side][s] >= lo && at[side][s] < hi && at[side][s - 2] >= lo) {
            const uint32_t w = 23 - (uint32_t)k;
            ok = !((at[side][s] >> w) == (at[side][s - 2] >> w) &&
                   (at[side][s - 2] & ((1u << w) - 1)));
          }
        if (ok) break;
      }
      if (ex == ONE_EX && k) return 0;
      k_of[side][ex & 31] = k;
    }
  }
  int nan_label = -1; /* NaN's: a label of index 0 */
  for (int l = 0; l < n_labels && nan_label < 0; l++)
    if (f->index[l] == 0) nan_label = l;
  if (nan_label < 0 || !place_binades(k_of, pos)) return 0;
  pos[0][ONE_EX & 31] = 0, pos[1][ONE_EX & 31] = 1;
  for (int b = 0; b < 7; b++) memset(f->cell[b], 0xff, 256); /* no steps */
  f->cell[0][128] = f->cell[0][129] = (uint8_t)nan_label;
  for (uint32_t side = 0; side < 2; side++)
    for (uint32_t ex = Q8_LO >> 23; ex <= ONE_EX; ex++) {
      const int k = k_of[side][ex & 31];
      const uint32_t lo = ex << 23, w = 23 - (uint32_t)k;
      const uint32_t off = ((uint32_t)pos[side][ex & 31] - (ex << k)) & 0xff;
      f->binade[side * 32 + (ex & 31)] = (uint16_t)((7 - k) | off << 8);
      for (uint32_t c = 0; c < (1u << k); c++) {
        const uint32_t start = lo + (c << w), end = start + (1u << w);
        const int at_cell = (pos[side][ex & 31] + (int)c) & 0xff;
        int label = first[side], inner = 0;
        uint32_t step[2] = {0xffffff, 0xffffff};
        for (int s = 0; s < n_at[side]; s++) {
          if (at[side][s] <= start) {
            label++;
          } else if (at[side][s] < end) {
            if (inner == 2) return 0;
            step[inner++] = at[side][s] & 0x7fffff;
          }
        }
        if (ex == Q8_LO >> 23 && c == 0 && inner) return 0;
        f->cell[0][at_cell] = (uint8_t)label;
        for (int b = 0; b < 3; b++) {
          f->cell[1 + b][at_cell] = (uint8_t)(step[0] >> (8 * b));
          f->cell[4 + b][at_cell] = (uint8_t)(step[1] >> (8 * b));
        }
      }
    }
  for (int e = 0; e < 32; e++) f->sel_hi[e] = (uint16_t)(2 * e + 1); /* z's top 16 bits */
  for (int e = 0; e < 64; e++) { /* byte e: element e's cell, mantissa bytes from 2 of 4 dwords */
    f->sel_cell[e] = (uint8_t)(2 * e);
    for (int k = 0; k < 3; k++) f->sel_byte[k][e] = (uint8_t)(4 * (e % 32) + k);
  }
  return 1;
}

static pthread_once_t built = PTHREAD_ONCE_INIT;
static void build(void) {
  build_planes(signed_planes, signed_values);
  build_planes(unsigned_planes, unsigned_values);
  build_cells(signed_cells, signed_runs, (int)(sizeof signed_runs / sizeof *signed_runs));
  build_cells(unsigned_cells, unsigned_runs, (int)(sizeof unsigned_runs / sizeof *unsigned_runs));
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
      __builtin_cpu_supports("avx512vbmi2")) {
    if (build_fast(&unsigned_fast, unsigned_cells)) maps[0].fast = &unsigned_fast;
    if (build_fast(&signed_fast, signed_cells)) maps[1].fast = &signed_fast;
  }
}

int lz_q8_fast_ok(const lz_q8_map *map) { return map->fast != NULL; }

const lz_q8_map *lz_q8_map_get(int is_signed) {
  pthread_once(&built, build);
  return &maps[is_signed ? 1 : 0];
}

static inline __attribute__((always_inline)) uint8_t index_of(const uint32_t *cells, float z) {
  uint32_t u;
  memcpy(&u, &z, sizeof u);
  uint32_t a = u & 0x7fffffffu;
  a = a < Q8_LO ? Q8_LO : a > Q8_ONE ? Q8_ONE : a;
  const uint32_t e = cells[((a - Q8_LO) >> 16) + (u >> 31) * Q8_SIDE];
  const uint8_t i = (uint8_t)((a & 0xffff) >= (e & 0xffff) ? e >> 24 : e >> 16);
  return z == z ? i : 0;
}

uint8_t lz_q8_index(const lz_q8_map *map, float z) { return index_of(map->cells, z); }

LZ_Q8_FAST void lz_q8_quantize64_exact(const lz_q8_fast *f, const float *x, __m512 absmax,
                                       int recip, __m512 r, uint8_t *q) {
  lz_q8_quantize_groups(f, x, absmax, recip, r, q, 1, 0);
}

LZ_Q8_FAST void lz_q8_quantize128_exact(const lz_q8_fast *f, const float *x, __m512 absmax,
                                        int recip, __m512 r, uint8_t *q) {
  lz_q8_quantize_groups(f, x, absmax, recip, r, q, 2, 0);
}

LZ_Q8_FAST void lz_q8_quantize_fast(const lz_q8_map *map, const float *x, float absmax, uint8_t *q,
                                    int64_t n) {
  const __m512 b = _mm512_set1_ps(absmax), r = _mm512_set1_ps(1.0f / absmax);
  const int recip = lz_q8_recip_ok(absmax);
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) lz_q8_quantize128(map->fast, x + i, b, recip, r, q + i);
  if (i + 64 <= n) lz_q8_quantize64(map->fast, x + i, b, recip, r, q + i);
}

static void quantize_scalar(const lz_q8_map *map, const float *x, float absmax, uint8_t *q,
                            int64_t n) {
  for (int64_t i = 0; i < n; i++) q[i] = index_of(map->cells, x[i] / absmax);
}

__attribute__((target("avx512f"))) static void quantize_gathers(const lz_q8_map *map,
                                                                const float *x, float absmax,
                                                                uint8_t *q, int64_t n) {
  const __m512 vmax = _mm512_set1_ps(absmax);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128((__m128i *)(q + i),
                     lz_q8_quantize16(map->cells, _mm512_loadu_ps(x + i), vmax));
  quantize_scalar(map, x + i, absmax, q + i, n - i);
}

__attribute__((target("avx2"))) static inline __m256i index8(const uint32_t *cells, __m256i u) {
  const __m256i lo = _mm256_set1_epi32((int)Q8_LO), low16 = _mm256_set1_epi32(0xffff);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i ac = _mm256_min_epu32(_mm256_max_epu32(a, lo), _mm256_set1_epi32((int)Q8_ONE));
  const __m256i cell =
      _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(ac, lo), 16),
                       _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32((int)Q8_SIDE)));
  const __m256i e = _mm256_i32gather_epi32((const int *)cells, cell, 4);
  const __m256i l = _mm256_and_si256(ac, low16), s = _mm256_and_si256(e, low16);
  /* both operands < 2^16: the signed compare is the unsigned one */
  return _mm256_blendv_epi8(_mm256_srli_epi32(e, 24),
                            _mm256_and_si256(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(0xff)),
                            _mm256_cmpgt_epi32(s, l));
}

/* lz_q8_div16 eight lanes at a time: the same operations, so the same
 * quotients and indices (test_quant8 checks every step through both). */
__attribute__((target("avx2,fma"))) static inline __m256 div8(__m256 x, __m256 b, __m256 r) {
  const __m256 q0 = _mm256_mul_ps(x, r);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, b, x), r, q0);
}

/* z = x / absmax by lz_q8_div16's corrected product where lz_q8_recip_ok
 * (two of the 8-bit step's four divisions an element), else divided. */
__attribute__((target("avx2,fma"))) static void quantize_avx2(const lz_q8_map *map, const float *x,
                                                              float absmax, uint8_t *q,
                                                              int64_t n) {
  const __m256 vmax = _mm256_set1_ps(absmax), r = _mm256_set1_ps(1.0f / absmax);
  const int recip = lz_q8_recip_ok(absmax);
  /* byte 0 of each 32-bit lane into the low 4 bytes of each half */
  const __m256i gather_bytes =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    const __m256 z = recip ? div8(xi, vmax, r) : _mm256_div_ps(xi, vmax);
    const __m256i idx = _mm256_and_si256(index8(map->cells, _mm256_castps_si256(z)),
                                         _mm256_castps_si256(_mm256_cmp_ps(z, z, _CMP_ORD_Q)));
    const __m256i packed = _mm256_shuffle_epi8(idx, gather_bytes);
    const uint32_t q0 = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(packed));
    const uint32_t q1 = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(packed, 1));
    memcpy(q + i, &q0, 4);
    memcpy(q + i + 4, &q1, 4);
  }
  quantize_scalar(map, x + i, absmax, q + i, n - i);
}

__attribute__((target("avx512f"))) static void quantize_avx512(const lz_q8_map *map, const float *x,
                                                               float absmax, uint8_t *q,
                                                               int64_t n) {
  int64_t i = 0;
  if (map->fast) {
    i = n / 64 * 64;
    lz_q8_quantize_fast(map, x, absmax, q, i);
  }
  quantize_gathers(map, x + i, absmax, q + i, n - i);
}

lz_q8_quantize_fn lz_q8_quantizer_at(int level) {
  __builtin_cpu_init();
  if (level >= 2 && __builtin_cpu_supports("avx512f"))
    return level == 2 ? quantize_gathers : quantize_avx512;
  if (level >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return quantize_avx2;
  return quantize_scalar;
}

lz_q8_quantize_fn lz_q8_quantizer(void) { return lz_q8_quantizer_at(3); }
