// specdeploy-host: a greedy completion of a specdeploy bundle through onnxruntime-genai's C API.
//
//   specdeploy-host BUNDLE PROMPT_FILE MAX_NEW_TOKENS
//
// BUNDLE is a folder holding genai_config.json: the bundle root decodes speculatively (the draft
// proposes, the target verifies), BUNDLE/target runs the target alone (a bundle without a draft
// model has only that one). The prompt file is read as
// is (no newline stripped). Only the generated text goes to stdout, streamed as it is accepted;
// statistics go to stderr. Bad input: one "error: ..." line and exit status 2; a failure while
// generating: exit status 1.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "oga.h"

namespace {

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws with genai's message when a call fails.
template <typename Error = std::runtime_error>
void check(OgaResult* result, const std::string& what) {
  if (result == nullptr) return;
  std::string message = what + ": " + OgaResultGetError(result);
  OgaDestroyResult(result);
  throw Error(message);
}

template <typename T, void (*Destroy)(T*)>
struct Deleter {
  void operator()(T* object) const { Destroy(object); }
};
template <typename T, void (*Destroy)(T*)>
using Owned = std::unique_ptr<T, Deleter<T, Destroy>>;

using Model = Owned<OgaModel, OgaDestroyModel>;
using Tokenizer = Owned<OgaTokenizer, OgaDestroyTokenizer>;
using TokenizerStream = Owned<OgaTokenizerStream, OgaDestroyTokenizerStream>;
using Sequences = Owned<OgaSequences, OgaDestroySequences>;
using GeneratorParams = Owned<OgaGeneratorParams, OgaDestroyGeneratorParams>;
using Generator = Owned<OgaGenerator, OgaDestroyGenerator>;
using SpeculativeStats = Owned<OgaSpeculativeStats, OgaDestroySpeculativeStats>;

struct Options {
  std::string bundle;
  std::string prompt;
  int max_new_tokens = 0;
};

Options parse_arguments(int argc, char** argv) {
  if (argc != 4) throw BadInput("usage: specdeploy-host BUNDLE PROMPT_FILE MAX_NEW_TOKENS");
  Options options;
  options.bundle = argv[1];
  if (!std::ifstream(options.bundle + "/genai_config.json"))
    throw BadInput(options.bundle + " has no genai_config.json (export it with specdeploy; the manifest's "
                   "genai section says why a bundle has none, and BUNDLE/target runs the target alone)");
  std::ifstream prompt_file(argv[2], std::ios::binary);
  if (!prompt_file) throw BadInput(std::string("cannot read the prompt file ") + argv[2]);
  std::ostringstream prompt;
  prompt << prompt_file.rdbuf();
  options.prompt = prompt.str();
  char* end = nullptr;
  long count = std::strtol(argv[3], &end, 10);
  if (*argv[3] == '\0' || *end != '\0' || count < 1 || count > 1000000)
    throw BadInput(std::string("MAX_NEW_TOKENS must be a positive integer (got '") + argv[3] + "')");
  options.max_new_tokens = static_cast<int>(count);
  return options;
}

// genai_config.json's model.context_length (the bundle's max context), which max_length may not pass;
// 0 when the file does not state it. The file is the exporter's own JSON, one key per line.
long context_length(const std::string& bundle) {
  std::ifstream config(bundle + "/genai_config.json");
  std::string line;
  const std::string key = "\"context_length\":";
  while (std::getline(config, line)) {
    size_t at = line.find(key);
    if (at != std::string::npos) return std::strtol(line.c_str() + at + key.size(), nullptr, 10);
  }
  return 0;
}

// The prompt's token ids as genai's tokenizer gives them; an empty prompt starts from BOS.
std::vector<int32_t> encode(const OgaTokenizer* tokenizer, const std::string& prompt) {
  OgaSequences* raw = nullptr;
  check(OgaCreateSequences(&raw), "creating sequences");
  Sequences sequences(raw);
  check(OgaTokenizerEncode(tokenizer, prompt.c_str(), sequences.get()), "encoding the prompt");
  const int32_t* data = OgaSequencesGetSequenceData(sequences.get(), 0);
  std::vector<int32_t> ids(data, data + OgaSequencesGetSequenceCount(sequences.get(), 0));
  if (ids.empty()) {
    int32_t bos = 0;
    check(OgaTokenizerGetBosTokenId(tokenizer, &bos), "reading the BOS token");
    ids.push_back(bos);
  }
  return ids;
}

uint64_t stat(const OgaSpeculativeStats* stats, const char* name) {
  uint64_t value = 0;
  check(OgaSpeculativeStatsGetCount(stats, name, &value), std::string("reading the statistic ") + name);
  return value;
}

// Statistics to stderr: token counts, prefill time, decode rate and, when drafting, acceptance.
void report(const OgaGenerator* generator, size_t prompt_tokens, int new_tokens, double prefill_s, double decode_s) {
  OgaSpeculativeStats* raw = nullptr;
  check(OgaGenerator_GetSpeculativeStats(generator, &raw), "reading speculative statistics");
  SpeculativeStats stats(raw);
  std::fprintf(stderr, "\n%zu prompt tokens, %d new tokens; prefill %.1f ms, decode %.1f tokens/s\n", prompt_tokens,
               new_tokens, 1000.0 * prefill_s, decode_s > 0 ? new_tokens / decode_s : 0.0);
  uint64_t proposed = stat(stats.get(), "draft_tokens_proposed");
  if (proposed > 0) {
    uint64_t accepted = stat(stats.get(), "draft_tokens_accepted");
    std::fprintf(stderr, "speculative: %llu of %llu draft tokens accepted (%.2f), %llu target passes\n",
                 static_cast<unsigned long long>(accepted), static_cast<unsigned long long>(proposed),
                 static_cast<double>(accepted) / static_cast<double>(proposed),
                 static_cast<unsigned long long>(stat(stats.get(), "target_forward_passes")));
  }
}

void complete(const Options& options) {
  using Clock = std::chrono::steady_clock;
  OgaModel* raw_model = nullptr;
  check<BadInput>(OgaCreateModel(options.bundle.c_str(), &raw_model), "loading " + options.bundle);
  Model model(raw_model);
  OgaTokenizer* raw_tokenizer = nullptr;
  check<BadInput>(OgaCreateTokenizer(model.get(), &raw_tokenizer), "loading the tokenizer");
  Tokenizer tokenizer(raw_tokenizer);
  std::vector<int32_t> prompt_ids = encode(tokenizer.get(), options.prompt);
  // As `specdeploy run`: a prompt must leave the context room for one new token, and generation ends
  // at the context's end if MAX_NEW_TOKENS would pass it.
  size_t max_length = prompt_ids.size() + options.max_new_tokens;
  long context = context_length(options.bundle);
  if (context > 0 && prompt_ids.size() >= static_cast<size_t>(context))
    throw BadInput("the prompt has " + std::to_string(prompt_ids.size()) + " tokens; the bundle's max context is " +
                   std::to_string(context) + " (including new tokens)");
  if (context > 0 && max_length > static_cast<size_t>(context)) max_length = static_cast<size_t>(context);

  OgaGeneratorParams* raw_params = nullptr;
  check(OgaCreateGeneratorParams(model.get(), &raw_params), "creating generator parameters");
  GeneratorParams params(raw_params);
  check<BadInput>(OgaGeneratorParamsSetSearchNumber(params.get(), "max_length", static_cast<double>(max_length)),
                  "setting max_length");
  check(OgaGeneratorParamsSetSearchBool(params.get(), "do_sample", false), "setting greedy search");
  OgaGenerator* raw_generator = nullptr;
  check<BadInput>(OgaCreateGenerator(model.get(), params.get(), &raw_generator), "creating the generator");
  Generator generator(raw_generator);
  OgaTokenizerStream* raw_stream = nullptr;
  check(OgaCreateTokenizerStream(tokenizer.get(), &raw_stream), "creating the tokenizer stream");
  TokenizerStream stream(raw_stream);

  auto start = Clock::now();
  check(OgaGenerator_AppendTokens(generator.get(), prompt_ids.data(), prompt_ids.size()), "prefill");
  auto prefilled = Clock::now();
  int new_tokens = 0;
  while (!OgaGenerator_IsDone(generator.get())) {
    check(OgaGenerator_GenerateNextToken(generator.get()), "generating");
    const int32_t* tokens = nullptr;
    size_t count = 0;
    check(OgaGenerator_GetNextTokens(generator.get(), &tokens, &count), "reading the next token");
    for (size_t i = 0; i < count; ++i) {
      const char* piece = nullptr;
      check(OgaTokenizerStreamDecode(stream.get(), tokens[i], &piece), "decoding");
      std::fputs(piece, stdout);
      ++new_tokens;
    }
    std::fflush(stdout);
  }
  auto done = Clock::now();
  report(generator.get(), prompt_ids.size(), new_tokens, std::chrono::duration<double>(prefilled - start).count(),
         std::chrono::duration<double>(done - prefilled).count());
}

}  // namespace

int main(int argc, char** argv) {
  int status = 0;
  try {
    complete(parse_arguments(argc, argv));
  } catch (const BadInput& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    status = 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    status = 1;
  }
  OgaShutdown();
  return status;
}
