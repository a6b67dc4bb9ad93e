// The few functions of onnxruntime-genai's C API (ort_genai_c.h, 0.18) that specdeploy-host calls.
//
// Declared here, not included from the SDK: the wheel ships the shared library
// (onnxruntime_genai/libonnxruntime-genai.so) but no headers. Every function that can fail returns
// an OgaResult* (nullptr on success) whose message OgaResultGetError gives; the caller destroys it.
// Objects are opaque and each has its OgaDestroy* function.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

typedef struct OgaResult OgaResult;
typedef struct OgaModel OgaModel;
typedef struct OgaTokenizer OgaTokenizer;
typedef struct OgaTokenizerStream OgaTokenizerStream;
typedef struct OgaSequences OgaSequences;
typedef struct OgaGeneratorParams OgaGeneratorParams;
typedef struct OgaGenerator OgaGenerator;
typedef struct OgaSpeculativeStats OgaSpeculativeStats;

const char* OgaResultGetError(const OgaResult* result);
void OgaDestroyResult(OgaResult* result);
void OgaShutdown();  // releases the library's ONNX Runtime environment; call last

// config_path: a folder holding genai_config.json (the bundle, or its target-only folder).
OgaResult* OgaCreateModel(const char* config_path, OgaModel** out);
void OgaDestroyModel(OgaModel* model);

OgaResult* OgaCreateTokenizer(const OgaModel* model, OgaTokenizer** out);
void OgaDestroyTokenizer(OgaTokenizer* tokenizer);
// Appends the encoding of str to sequences as one more sequence.
OgaResult* OgaTokenizerEncode(const OgaTokenizer* tokenizer, const char* str, OgaSequences* sequences);
OgaResult* OgaTokenizerGetBosTokenId(const OgaTokenizer* tokenizer, int32_t* token_id);

OgaResult* OgaCreateTokenizerStream(const OgaTokenizer* tokenizer, OgaTokenizerStream** out);
void OgaDestroyTokenizerStream(OgaTokenizerStream* stream);
// The text one more token adds (maybe empty while a UTF-8 sequence is incomplete); *out lives until
// the next call.
OgaResult* OgaTokenizerStreamDecode(OgaTokenizerStream* stream, int32_t token, const char** out);

OgaResult* OgaCreateSequences(OgaSequences** out);
void OgaDestroySequences(OgaSequences* sequences);
size_t OgaSequencesGetSequenceCount(const OgaSequences* sequences, size_t sequence_index);  // tokens in it
const int32_t* OgaSequencesGetSequenceData(const OgaSequences* sequences, size_t sequence_index);

OgaResult* OgaCreateGeneratorParams(const OgaModel* model, OgaGeneratorParams** out);
void OgaDestroyGeneratorParams(OgaGeneratorParams* params);
// name: a genai_config.json "search" field ("max_length", "do_sample", ...).
OgaResult* OgaGeneratorParamsSetSearchNumber(OgaGeneratorParams* params, const char* name, double value);
OgaResult* OgaGeneratorParamsSetSearchBool(OgaGeneratorParams* params, const char* name, bool value);

OgaResult* OgaCreateGenerator(const OgaModel* model, const OgaGeneratorParams* params, OgaGenerator** out);
void OgaDestroyGenerator(OgaGenerator* generator);
OgaResult* OgaGenerator_AppendTokens(OgaGenerator* generator, const int32_t* input_ids, size_t input_ids_count);
bool OgaGenerator_IsDone(OgaGenerator* generator);  // max_length reached or an end-of-sequence token
OgaResult* OgaGenerator_GenerateNextToken(OgaGenerator* generator);
// The token(s) the last GenerateNextToken chose (one per sequence; batch 1 here).
OgaResult* OgaGenerator_GetNextTokens(const OgaGenerator* generator, const int32_t** out, size_t* out_count);

// Counters of draft-model speculative decoding ("draft_tokens_proposed", "draft_tokens_accepted",
// "target_forward_passes", ...); zero for a model without a draft.
OgaResult* OgaGenerator_GetSpeculativeStats(const OgaGenerator* generator, OgaSpeculativeStats** out);
void OgaDestroySpeculativeStats(OgaSpeculativeStats* stats);
OgaResult* OgaSpeculativeStatsGetCount(const OgaSpeculativeStats* stats, const char* name, uint64_t* value);

}  // extern "C"
